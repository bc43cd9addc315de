"""One benchmark step per variant, run on 2 gloo ranks in fresh processes (peak RSS is per process).

Variants (shared/benchmarks.md's Llama shape, widened to a 48k vocabulary so the model has
27.8M parameters, most of them in the embedding and the untied head, as in real LLMs):

* ``baseline``: plain HF model (sdpa), data parallel: every rank a whole sequence of its own
  (2 sequences per step on 2 ranks), gradients all-reduced;
* ``ulysses``: plait Ulysses at sp=2, full logits, ``sp_cross_entropy``;
* ``ulysses+alst``: plait Ulysses + tiled MLP + tiled logits/loss + checkpointed decoder layers
  (``enable_offloaded_checkpointing``; on this CPU-only machine the host copy is a second CPU
  tensor, so what it shows is checkpointing);
* ``ulysses+alst+fpdt``: ``ulysses+alst`` with FPDT's chunked attention inside
  (``UlyssesConfig(inner_attention="fpdt", fpdt_chunk=FPDT_CHUNK)``): blocks of
  ``FPDT_CHUNK x FPDT_CHUNK`` scores, q/k/v chunks "on the host" (on this CPU-only machine the
  same memory, so no copy is made);
* ``deepspeed-alst``: DeepSpeed 0.19.8's ``UlyssesSPAttentionHF`` (``register_with_transformers``),
  its ``TiledMLP`` and ``TiledFusedLogitsLoss`` and HF gradient checkpointing, without a DeepSpeed
  engine (plain AdamW and the same gradient all-reduce as ours, so only SP and tiling differ).
"""

from __future__ import annotations

import math
import resource
import time

import torch
import torch.distributed as dist

VOCAB, HIDDEN, LAYERS, HEADS, INTER = 48_000, 256, 4, 4, 688
VARIANTS = ("baseline", "ulysses", "ulysses+alst", "ulysses+alst+fpdt", "deepspeed-alst")
FPDT_CHUNK = 512  # tokens per FPDT chunk: the 1024-token timing length runs as 2 x 2 blocks (3 causal)


def build_model():
    """The benchmark's Llama (fp32, sdpa, random weights, seed 0)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=HEADS, intermediate_size=INTER,
                                      max_position_embeddings=1 << 17, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config)


def _batch(seq: int, sample: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seq + 1_000_003 * sample)
    ids = torch.randint(0, VOCAB, (1, seq), generator=gen)
    return {"input_ids": ids, "labels": ids}


def _all_reduce_grads(model: torch.nn.Module) -> None:
    from plait.kernels import collectives

    for p in model.parameters():
        if p.grad is not None:
            collectives.all_reduce(p.grad)


def _plait_step(alst: bool, fpdt: bool = False):
    from plait.ulysses_sp import UlyssesConfig, shard_batch, sp_cross_entropy, sp_tiled_cross_entropy
    from plait.ulysses_sp.hf import apply_ulysses
    from plait.ulysses_sp.offload import enable_offloaded_checkpointing

    model = build_model()
    apply_ulysses(model, config=UlyssesConfig(tiled_mlp_chunks=None, inner_attention="fpdt" if fpdt else None,
                                              fpdt_chunk=FPDT_CHUNK))
    if alst:
        enable_offloaded_checkpointing(model)
    model.train()

    def step(seq: int, sample: int, micro_batches: int) -> float:
        local = shard_batch(_batch(seq, sample))
        if alst:
            chunks = max(1, math.ceil(local["input_ids"].shape[1] / HIDDEN))
            from plait.ulysses_sp import tile_mlp
            from plait.ulysses_sp.hf import decoder_mlps

            for mlp in decoder_mlps(model):
                tile_mlp(mlp, chunks=chunks)
            hidden = model.model(input_ids=local["input_ids"], position_ids=local["position_ids"]).last_hidden_state
            share = sp_tiled_cross_entropy(hidden, model.lm_head, local["shift_labels"], chunks=chunks)
        else:
            logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
            share = sp_cross_entropy(logits, local["shift_labels"])
        (share / micro_batches).backward()  # the mean over the step's micro-batches
        return share.item()

    return model, step


def _baseline_step():
    model = build_model()
    model.train()

    def step(seq: int, sample: int, micro_batches: int) -> float:
        loss = model(**_batch(seq, sample)).loss  # data parallel: a sequence of its own per rank
        (loss / micro_batches).backward()
        return loss.item()

    return model, step


def _deepspeed_step():
    import deepspeed
    from deepspeed.runtime.sequence_parallel.ulysses_sp import (
        TiledFusedLogitsLoss,
        TiledMLP,
        UlyssesSPAttentionHF,
    )

    from plait.ulysses_sp import shard_batch

    deepspeed.init_distributed(dist_backend="gloo")  # deepspeed.comm wraps the existing process group
    model = build_model()
    UlyssesSPAttentionHF.register_with_transformers(model, "sdpa", sequence_parallel_size=dist.get_world_size(),
                                                    micro_batch_size=1, seq_length_is_variable=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()

    def mlp_forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))

    for layer in model.model.layers:
        mlp = layer.mlp
        params = [mlp.down_proj.weight, mlp.gate_proj.weight, mlp.up_proj.weight]
        mlp.forward = (lambda m, p: lambda x: TiledMLP.apply(mlp_forward, m, x, max(1, math.ceil(x.shape[1] / HIDDEN)),
                                                             p))(mlp, params)

    def loss_fn(head, x, y):
        logits = head(x).float()
        return torch.nn.functional.cross_entropy(logits.view(-1, VOCAB), y.view(-1), ignore_index=-100,
                                                 reduction="sum")

    def step(seq: int, sample: int, micro_batches: int) -> float:
        local = shard_batch(_batch(seq, sample))  # same slices, position ids and shifted labels as ours
        hidden = model.model(input_ids=local["input_ids"], position_ids=local["position_ids"]).last_hidden_state
        shards = max(1, math.ceil(hidden.shape[1] / HIDDEN))
        total = (local["shift_labels"] != -100).sum().float()
        dist.all_reduce(total)
        loss = TiledFusedLogitsLoss.apply(loss_fn, model.lm_head, hidden, local["shift_labels"], None, shards,
                                          [model.lm_head.weight], "sum") / total
        (loss / micro_batches).backward()
        return loss.item()

    return model, step


def run_variant(variant: str, seq: int, steps: int, micro_batches: int = 1) -> dict[str, float]:
    """One rank's part: build, ``steps`` training steps at ``seq`` tokens; peak RSS and step times.

    Args:
        variant: one of :data:`VARIANTS`.
        seq: tokens per sequence (global: the sp variants split it over both ranks).
        steps: optimizer steps.
        micro_batches: sequences per step, one after another with their gradients accumulated
            (the sp variants' way to train as many sequences per step as the data-parallel
            baseline, which trains one per rank).

    Returns:
        ``peak_rss_gib`` (this process's maximum resident set), ``step_s`` (median step time,
        the first step excluded when there are more), ``cpu_s`` (the same step's CPU time of
        this process, all its threads: what other jobs on the machine barely change) and ``loss``.
    """
    torch.set_num_threads(1)
    if variant == "baseline":
        model, step = _baseline_step()
    elif variant == "deepspeed-alst":
        model, step = _deepspeed_step()
    else:
        model, step = _plait_step(alst=variant.startswith("ulysses+alst"), fpdt=variant.endswith("fpdt"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, cpu, loss = [], [], float("nan")
    sample = dist.get_rank() if variant == "baseline" else 0  # the baseline's ranks train different sequences
    for _ in range(steps):
        start, cpu_start = time.perf_counter(), time.process_time()
        for micro in range(micro_batches):
            loss = step(seq, sample + 2 * micro, micro_batches)
        _all_reduce_grads(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    kept, kept_cpu = sorted(times[1:] or times), sorted(cpu[1:] or cpu)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_rss_gib": peak_kib / 2**20, "step_s": kept[len(kept) // 2], "cpu_s": kept_cpu[len(kept_cpu) // 2],
            "loss": loss}
