"""Activation checkpointing per block and the tiled LM head under ZeRO-3 + ZeRO-Infinity.

``checkpoint_blocks`` (plait-zero-sharding) recomputes each decoder block in backward and
``tile_lm_head`` (plait-ulysses-sp) computes the loss with the logits in sequence chunks,
recomputed in backward. Tested here: that they change nothing but memory (the same losses and
parameters, bitwise for checkpointing, within rounding for the tiled loss; gradients of the tiled
loss against the untiled one), that under ZeRO-3 with parameters on disk the recompute runs with
the block's unit gathered again after the forward released it, and that the forward's rise of
the peak resident set is then held to a bound from the formula (the gathered units, each
block's input, one block's activations and one tile of logits), which the same model without
them exceeds.
"""

from __future__ import annotations

import os

import pytest
import torch

from plait.kernels.testing import run_distributed

SHAPE = dict(vocab=512, dim=64, layers=3, heads=2)
BATCH, SEQ, CHUNKS = 2, 16, 4
# The memory test's model: activations (12 blocks x 512 tokens) dominate its forward.
MEM_SHAPE = dict(vocab=4096, dim=256, layers=12, heads=4)
MEM_BATCH, MEM_SEQ, MEM_CHUNKS = 4, 128, 8


def _tokens(step: int, shape: dict, batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, shape["vocab"], (batch, seq), generator=torch.Generator().manual_seed(step))


def _plain_grads(mode: str) -> tuple[float, dict[str, torch.Tensor]]:
    from plait.offload_io.benchmarks.plain_decoder import PlainDecoder, bound_activations
    from plait.zero_sharding import checkpoint_blocks

    torch.manual_seed(0)
    model = PlainDecoder(**SHAPE)
    if mode == "checkpoint":
        checkpoint_blocks(model)
    elif mode == "both":
        bound_activations(model, loss_chunks=CHUNKS)
    loss = model(_tokens(0, SHAPE, BATCH, SEQ))
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_checkpointing_and_tiled_loss_keep_loss_and_gradients() -> None:
    pytest.importorskip("plait.ulysses_sp")
    loss, grads = _plain_grads("none")
    loss_ckpt, grads_ckpt = _plain_grads("checkpoint")
    assert loss_ckpt == loss
    for name, grad in grads.items():
        assert torch.equal(grads_ckpt[name], grad), name  # the recompute runs the same kernels
    loss_both, grads_both = _plain_grads("both")
    assert loss_both == pytest.approx(loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_both[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_checkpoint_blocks_refuses_a_model_without_blocks_and_undoes() -> None:
    from plait.zero_sharding import checkpoint_blocks, uncheckpoint_blocks

    with pytest.raises(ValueError, match="no nn.ModuleList"):
        checkpoint_blocks(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="not a submodule"):
        checkpoint_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)), blocks=[torch.nn.Linear(2, 2)])
    model = torch.nn.Sequential(torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)]))
    assert checkpoint_blocks(model) == 2 and checkpoint_blocks(model) == 2  # idempotent
    assert uncheckpoint_blocks(model) == 2 and "forward" not in vars(model[0][0])


def _zero_run(root: str, mode: str) -> dict:
    """Three ZeRO-3 steps with parameters, masters, state and gradients on disk (one rank)."""
    from plait.offload_io import OffloadConfig, zero_placement
    from plait.offload_io.benchmarks.plain_decoder import PlainDecoder, bound_activations
    from plait.zero_sharding import ZeroConfig, checkpoint_blocks, sharded_init, zero_shard

    placement = zero_placement(OffloadConfig(device="nvme", param_device="nvme", grad_device="nvme",
                                             path=os.path.join(root, mode), sub_group_size=1 << 14))
    torch.manual_seed(0)
    with sharded_init(placement=placement):
        model = PlainDecoder(**SHAPE)
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), placement=placement, lr=1e-3,
                                  fused=True)
    if mode == "checkpoint":
        checkpoint_blocks(model)
    elif mode == "both":
        bound_activations(model, loss_chunks=CHUNKS)
    calls = []
    model.blocks[0].up.register_forward_hook(lambda *_: calls.append(1))
    block_units = [u for b in model.blocks for u in model.zero_engine.partition.module_units[b]]
    losses, released = [], []
    for step in range(3):
        loss = model(_tokens(step, SHAPE, BATCH, SEQ))
        released.append(all(not u.gathered for u in block_units))  # the recompute must gather again
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    from plait.zero_sharding import iter_full_parameters

    params = {name: value.clone() for name, value in iter_full_parameters(model.zero_engine)}
    placement.close()
    return {"losses": losses, "params": params, "calls": len(calls), "released": released}


@pytest.fixture(scope="module")
def zero_results(tmp_path_factory) -> dict:
    """One fresh rank runs the ZeRO parity runs, then (their warm-up done) the memory runs."""
    pytest.importorskip("plait.ulysses_sp")
    return run_distributed(_zero_and_memory, 1, str(tmp_path_factory.mktemp("activations")), timeout=240)[0]


def _zero_and_memory(root: str) -> dict:
    import ctypes

    # M_MMAP_THRESHOLD: tensors of 64 KiB and more get their own mappings, returned when freed, so
    # a phase's peak counts what is live rather than blocks glibc's heap kept (as in the budget test)
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)
    runs = [_zero_run(root, mode) for mode in ("none", "checkpoint", "both")]
    return {"runs": runs, "memory": _forward_peaks(root)}


@pytest.mark.timeout(300)
def test_zero_infinity_recompute_regathers_and_matches(zero_results) -> None:
    base, ckpt, both = zero_results["runs"]
    assert base["calls"] == 3 and ckpt["calls"] == 6 and both["calls"] == 6  # recomputed once per step
    assert all(ckpt["released"]) and all(both["released"])
    assert ckpt["losses"] == base["losses"]
    for name, value in base["params"].items():
        assert torch.equal(ckpt["params"][name], value), name
    # Not the parameters: AdamW turns rounding in a gradient that is zero in exact arithmetic
    # (the key bias's: softmax ignores a shift) into a whole update; the gradients are compared above.
    assert both["losses"] == pytest.approx(base["losses"], rel=1e-5)


def _forward_peaks(root: str) -> dict:
    from plait.offload_io import IOConfig, OffloadConfig
    from plait.offload_io.benchmarks.plain_decoder import PlainDecoder, bound_activations, phase_peaks

    config = OffloadConfig(device="nvme", param_device="nvme", grad_device="nvme", path=root, sub_group_size=1 << 16,
                           io=IOConfig(block_size=1 << 20, queue_depth=4, workers=2))

    def build(bounded: bool, layers: int):
        def make():
            model = PlainDecoder(**{**MEM_SHAPE, "layers": layers})
            if bounded:
                bound_activations(model, loss_chunks=MEM_CHUNKS)
            return model
        return make

    result = {}
    phase_peaks(MEM_SHAPE, os.path.join(root, "warm"), placement_config=config, steps=1, batch=MEM_BATCH,
                seq=MEM_SEQ, build=build(True, 1))  # warm-up: this shape's first kernels
    for bounded in (False, True):
        run = phase_peaks(MEM_SHAPE, os.path.join(root, str(bounded)), placement_config=config, steps=1,
                          batch=MEM_BATCH, seq=MEM_SEQ, build=build(bounded, MEM_SHAPE["layers"]))
        result[bounded] = {"forward": run["peak_bytes"]["forward"], "losses": run["losses"]}
    return result


@pytest.mark.timeout(300)
def test_forward_peak_is_one_block_and_one_tile(zero_results) -> None:
    result = zero_results["memory"]
    d, v, tokens = MEM_SHAPE["dim"], MEM_SHAPE["vocab"], MEM_BATCH * MEM_SEQ
    largest_unit = v * d * 4  # the embedding or the head, fp32
    block = 16 * d * 4 + 4 * (4 * d) * 4  # saved values per token of one block: 16 of width d, 4 of the MLP's 4d
    # three gathered units (computing, read ahead, its gradient), each block's input and output,
    # one block's activations live in its forward or recompute, one tile of logits four times
    # (fp32 logits, log-softmax, their gradient, a cast), and 16 MiB of allocator and I/O slack
    bound = (3 * largest_unit + 2 * MEM_SHAPE["layers"] * tokens * d * 4 + tokens * block
             + 4 * tokens // MEM_CHUNKS * v * 4 + (16 << 20))
    assert result[False]["forward"] > bound, (result, bound)  # without them the forward holds every block
    assert result[True]["forward"] < bound, (result, bound)
    print("forward rise (MiB)", {k: v["forward"] >> 20 for k, v in result.items()}, "bound", bound >> 20)
    assert result[True]["losses"] == pytest.approx(result[False]["losses"], rel=1e-5)
