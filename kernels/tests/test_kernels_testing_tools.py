"""tiny-llama, the corpus and the tokenizer are what benchmarks.md says they are."""

import math
import subprocess
import sys
import uuid

import pytest
import torch

from plait.kernels.testing import (
    ByteTokenizer,
    CorpusDataset,
    SessionTimeoutError,
    TinyLlamaConfig,
    conditional_entropy,
    corpus_text,
    corpus_tokens,
    corpus_words,
    global_batch,
    live_processes_mentioning,
    rank_slice,
    run_in_session,
    text_words,
    tiny_llama,
    tiny_llama_moe,
)


def test_tiny_llama_has_the_benchmark_shape():
    model = tiny_llama()
    cfg = model.config
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.intermediate_size) == (
        4096, 256, 8, 4, 64, 688)
    numel = sum(p.numel() for p in model.parameters())
    assert 8.3e6 < numel < 8.5e6
    assert model.lm_head.weight.data_ptr() != model.embed_tokens.weight.data_ptr()  # untied


def test_moe_variant_swaps_every_other_mlp():
    model = tiny_llama_moe(num_layers=4, hidden_size=32, num_heads=2, intermediate_size=48, vocab_size=300)
    kinds = [type(block.mlp).__name__ for block in model.layers]
    assert kinds == ["SwiGLU", "MoEMLP", "SwiGLU", "MoEMLP"]
    assert len(model.layers[1].mlp.experts) == 8
    batch = global_batch(0, 2, 16)
    loss = model(**batch).loss
    loss.backward()
    assert torch.isfinite(loss)


def test_loss_goes_down_and_generation_is_deterministic():
    torch.manual_seed(0)
    model = tiny_llama(num_layers=2, hidden_size=64, num_heads=2, intermediate_size=96, vocab_size=300)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(15):
        loss = model(**global_batch(step, 8, 32)).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0
    prompt = torch.tensor([ByteTokenizer().encode("The ")])
    assert torch.equal(model.generate(prompt, 5), model.generate(prompt, 5))


def test_batches_are_a_function_of_seed_and_step():
    a, b = global_batch(3, 4, 32, seed=1), global_batch(3, 4, 32, seed=1)
    assert torch.equal(a["input_ids"], b["input_ids"])
    assert not torch.equal(a["input_ids"], global_batch(4, 4, 32, seed=1)["input_ids"])
    assert torch.equal(a["labels"][:, :-1], a["input_ids"][:, 1:])
    halves = [rank_slice(a, r, 2)["input_ids"] for r in range(2)]
    assert torch.equal(torch.cat(halves), a["input_ids"])
    with pytest.raises(ValueError, match="not divisible"):
        rank_slice(a, 0, 3)


def test_tokenizer_round_trips_the_corpus():
    tok = ByteTokenizer()
    text = corpus_text()
    assert len(text) > 5000 and tok.decode(tok.encode(text)) == text
    assert tok.encode("a", add_bos=True) == [tok.bos_id, 97]
    assert len(CorpusDataset(64)) > 50


def test_conditional_entropy_of_known_sequences_and_the_corpus():
    assert conditional_entropy([1, 2] * 50) == pytest.approx(math.log(2))  # two letters, equally often
    assert conditional_entropy([1, 2] * 50, context=1) == 0.0  # each letter fixes the next
    assert conditional_entropy([7, 7, 7]) == 0.0
    tokens = corpus_tokens().tolist()
    unigram, bigram = conditional_entropy(tokens), conditional_entropy(tokens, context=1)
    assert 2.5 < unigram < 3.5 and bigram < unigram  # English letters: about 4.1 bits = 2.9 nats
    with pytest.raises(ValueError, match="context=-1"):
        conditional_entropy(tokens, context=-1)
    with pytest.raises(ValueError, match="context=3"):
        conditional_entropy([1, 2, 3], context=3)


def test_words_of_a_text_and_of_the_corpus():
    assert text_words("The loom's warp, 3 threads") == ["the", "loom", "s", "warp", "threads"]
    assert text_words("a weaver cou", drop_cut_off=True) == ["a", "weaver"]
    assert text_words("a weaver.", drop_cut_off=True) == ["a", "weaver"]
    assert text_words("", drop_cut_off=True) == []
    assert {"the", "weaver", "ledger"} <= corpus_words() and "checkpoint" not in corpus_words()


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="num_heads=3"):
        TinyLlamaConfig(hidden_size=64, num_heads=3)
    with pytest.raises(ValueError, match="top_k"):
        TinyLlamaConfig(num_experts=2, top_k=3)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_process_scan_finds_a_live_process_by_its_command_line_and_not_once_it_is_reaped():
    token = f"plait-scan-{uuid.uuid4().hex}"
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", token])
    try:
        found = live_processes_mentioning(token)
        assert len(found) == 1 and found[0].startswith(f"{child.pid}: ") and token in found[0]
    finally:
        child.kill()
        child.wait()
    assert live_processes_mentioning(token) == []


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc")
def test_a_job_run_in_its_own_session_is_killed_whole_when_it_overruns():
    token = f"plait-session-{uuid.uuid4().hex}"
    # The job starts a grandchild that would outlive a plain kill of the job itself.
    job = ("import subprocess, sys, time; print('started', flush=True); "
           f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', '{token}']); time.sleep(60)")
    with pytest.raises(SessionTimeoutError, match="still ran after 3 s") as caught:
        run_in_session([sys.executable, "-c", job, token], limit_s=3)
    assert "started" in caught.value.output
    assert live_processes_mentioning(token) == []


def test_a_finished_job_gives_its_exit_code_and_the_output_asked_for():
    code = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"
    both = run_in_session([sys.executable, "-c", code], limit_s=60)
    assert both.rc == 3 and "out" in both.output and "err" in both.output
    only = run_in_session([sys.executable, "-c", code], limit_s=60, keep="stderr")
    assert only.rc == 3 and only.output.strip() == "err"
    with pytest.raises(ValueError, match="keep='stdout'"):
        run_in_session([sys.executable, "-c", code], limit_s=60, keep="stdout")
