"""Phase by phase under one knob: models nobody wrote for plait (an ``nn.ModuleList`` decoder and
an HF Llama) built under ``sharded_init(placement=...)``, sharded with ZeRO-3 and trained with
``OffloadConfig(memory_budget=...)`` as the only offload setting, one rank.

Each phase's rise of the peak resident set (``VmHWM`` reset at its start, in a fresh process
after a small warm-up run has mapped the libraries) is held to the part of the budget that is not
the runtime (``budget - RUNTIME_BYTES``: the store's slots, I/O buffers, three of the largest unit
and the gradients the budget chose to keep) plus the batch's activations, for a model larger than
that part, so a phase that held the model would fail. ``zero_shard`` included: it hands each unit
to the files as soon as it is built (plait.offload_io.master_release), so it never holds the
model, even at world size 1 where a rank's shard is the whole unit.
"""

from __future__ import annotations

import os

import pytest

from plait.kernels.testing import run_distributed

BUDGET = 296 << 20
PLAIN = dict(vocab=4096, dim=256, layers=24, heads=4)
LLAMA = dict(vocab_size=4096, hidden_size=256, intermediate_size=688, num_hidden_layers=24, num_attention_heads=4,
             num_key_value_heads=4, tie_word_embeddings=False)
BATCH, SEQ = 2, 32


def _build_and_loss(family: str, layers: int | None = None):
    """(build, loss) of a model of ``family`` (``layers`` overrides the depth: the warm-up)."""
    if family == "plain":
        from plait.offload_io.benchmarks.plain_decoder import PlainDecoder

        shape = {**PLAIN, "layers": layers or PLAIN["layers"]}
        return (lambda: PlainDecoder(**shape)), None
    import transformers

    config = transformers.LlamaConfig(**{**LLAMA, "num_hidden_layers": layers or LLAMA["num_hidden_layers"]})
    return (lambda: transformers.LlamaForCausalLM(config)), (lambda m, t: m(input_ids=t, labels=t).loss)


def _phases(root: str, family: str) -> dict:
    import ctypes

    from plait.offload_io import OffloadConfig
    from plait.offload_io.benchmarks.plain_decoder import phase_peaks

    # M_MMAP_THRESHOLD: tensors of 64 KiB and more get their own mappings, returned when freed, so
    # the peak counts what is live rather than glibc's heap keeping freed blocks (the HF Llama's
    # 256 KiB-700 KiB weights otherwise left a build rise anywhere between 39 and 78 MiB)
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)
    config = OffloadConfig(memory_budget=BUDGET, path=root)
    shape = {"vocab": PLAIN["vocab"]}
    build, loss = _build_and_loss(family, layers=1)  # warm-up: libraries, I/O engine, first kernels
    phase_peaks(shape, os.path.join(root, "warm"), placement_config=config, steps=1, batch=BATCH, seq=SEQ,
                build=build, loss=loss)
    build, loss = _build_and_loss(family)
    return phase_peaks(shape, os.path.join(root, "run"), placement_config=config, steps=2, batch=BATCH, seq=SEQ,
                       build=build, loss=loss)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["plain", "hf"])
def test_every_phase_stays_in_the_budget(tmp_path, family) -> None:
    if family == "hf":
        pytest.importorskip("transformers")
    from plait.offload_io.budget import RUNTIME_BYTES

    result = run_distributed(_phases, 1, str(tmp_path), family, timeout=200)[0]
    peaks, model_bytes = result["peak_bytes"], result["model_bytes"]
    # logits and their gradient in fp32, four times over (softmax, loss, casts), and 16 saved
    # values per width per token in every layer: small at this batch, counted so the bound is honest
    activations = 4 * BATCH * SEQ * PLAIN["vocab"] * 4 + PLAIN["layers"] * 16 * BATCH * SEQ * PLAIN["dim"] * 4
    bound = BUDGET - RUNTIME_BYTES + activations
    # measured (MiB, bound 69, models 80): decoder build 22, forward 39, backward 20, step 8;
    # HF Llama build 23, forward 49, backward 21, step 6; zero_shard 6 for both (83 and 84 when it held
    # every master until the optimizer existed)
    assert model_bytes > bound, (model_bytes, bound)  # the model does not fit the bound: the claim separates
    for phase in ("build", "shard", "forward", "backward", "step"):
        assert peaks[phase] < bound, (phase, peaks, bound)
    assert result["losses"][1] < result["losses"][0], result["losses"]
