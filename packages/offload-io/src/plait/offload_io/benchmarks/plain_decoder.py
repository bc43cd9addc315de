"""An ordinary torch decoder, nobody's plait model, and the peak memory of each training phase.

``PlainDecoder`` is what a user writes without plait in mind: ``nn.Embedding``, an
``nn.ModuleList`` of pre-norm blocks (``nn.LayerNorm``, a fused QKV ``nn.Linear`` with
``F.scaled_dot_product_attention``, a GELU MLP), a final norm and an untied ``nn.Linear`` head.
At vocab 32000, width 1024 and 12 layers it has 217M parameters.

:func:`phase_peaks` builds it under ``sharded_init`` (optionally with the placement, so the
construction goes straight to the store), shards it with ZeRO-3 and ZeRO-Infinity at world size 1
and trains a few steps, resetting the process's resident-set high-water mark (``VmHWM``) before
each phase, so each phase's own peak is measured, not the run's. Memory is load-independent;
``python -m plait.offload_io.benchmarks.plain_decoder --out FILE`` writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from plait.kernels.bench import reset_peak_rss, rss_bytes

FULL = dict(vocab=32000, dim=1024, layers=12, heads=16)
PHASES = ("build", "shard", "forward", "backward", "step")


class Block(nn.Module):
    """A pre-norm decoder block: causal self-attention and a 4x GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Args: x (batch, seq, dim). Returns: the same shape."""
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class PlainDecoder(nn.Module):
    """Embedding, ``nn.ModuleList`` of :class:`Block`, final norm, untied head.

    Args:
        vocab, dim, layers, heads: the shape (``FULL`` is the 217M one).
    """

    def __init__(self, *, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.tiled_loss = False  # set by bound_activations: the head computes the loss in chunks

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Args: tokens (batch, seq) int64. Returns: the next-token cross-entropy loss."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        hidden = self.norm(x)
        if self.tiled_loss:  # the head tiled by plait.ulysses_sp.tile_lm_head: never the whole logits
            return self.head(hidden[:, :-1], tokens[:, 1:])
        logits = self.head(hidden)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))


def bound_activations(model: PlainDecoder, *, loss_chunks: int) -> None:
    """Checkpoint every block and tile the head's loss, so that a forward holds one block's
    activations and ``1 / loss_chunks`` of the logits (plus each block's input).

    Args:
        model: the decoder, plain or sharded.
        loss_chunks: sequence chunks of the logits (:func:`plait.ulysses_sp.tile_lm_head`).
    """
    from plait.ulysses_sp import tile_lm_head
    from plait.zero_sharding import checkpoint_blocks

    checkpoint_blocks(model)
    tile_lm_head(model.head, chunks=loss_chunks)
    model.tiled_loss = True


def largest_module_bytes(model: nn.Module) -> int:
    """Bytes of the module owning the most parameter bytes directly or through its children that
    are not ``nn.ModuleList`` entries (a block, the embedding, the head)."""
    sizes = [sum(p.numel() * p.element_size() for p in m.parameters())
             for m in model.modules() if not isinstance(m, nn.ModuleList) and m is not model]
    return max(sizes, default=0)


def phase_peaks(shape: dict[str, int], root: str, *, placement_config: Any, steps: int = 2, batch: int = 2,
                seq: int = 64, straight_to_store: bool = True, build: Any = None, loss: Any = None) -> dict[str, Any]:
    """Build, shard and train :class:`PlainDecoder` (or ``build()``'s model) at world size 1, the
    peak of each phase.

    Args:
        shape: the decoder's keyword arguments (``vocab`` is also the token range with ``build``).
        root: directory for the offload files.
        placement_config: the ``OffloadConfig`` (its ``path`` is replaced by ``root``).
        steps: training steps (forward, backward, step each; each phase's largest peak over
            the steps is kept).
        batch, seq: tokens per step.
        straight_to_store: pass the placement to ``sharded_init`` (construction straight to the
            store) or build under a plain ``sharded_init()``.
        build: optional; makes another model (an HF Llama, say) instead of ``PlainDecoder(**shape)``.
        loss: optional; ``loss(model, tokens)`` for ``build``'s model (default ``model(tokens)``).

    Returns:
        ``{"peak_bytes": {phase: bytes over the level at the phase's start}, "model_bytes",
        "largest_module_bytes", "losses", "baseline_bytes", "peak_rss_bytes"}`` (the last: the
        process's highest resident set over the phases, imports included); needs ``torch.distributed``
        initialised (one process) and plait-zero-sharding.
    """
    import dataclasses

    from plait.offload_io import zero_placement
    from plait.zero_sharding import ZeroConfig, sharded_init, zero_shard

    placement = zero_placement(dataclasses.replace(placement_config, path=root))
    peaks: dict[str, int] = {}
    highest = [0]  # the largest VmHWM of any phase: the process's peak (each phase resets VmHWM)
    baseline = rss_bytes()[0]
    start = reset_peak_rss()
    torch.manual_seed(0)
    with sharded_init(placement=placement if straight_to_store else None):
        model = build() if build is not None else PlainDecoder(**shape)
    peaks["build"] = rss_bytes()[1] - start
    highest[0] = rss_bytes()[1]
    numel = sum(p.numel() for p in model.parameters())  # constructed parameters answer with the whole shape
    start = reset_peak_rss()
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(stage=3), placement=placement, lr=1e-3)
    peaks["shard"] = rss_bytes()[1] - start
    highest[0] = max(highest[0], rss_bytes()[1])
    tokens = torch.randint(0, shape["vocab"], (batch, seq), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        start = reset_peak_rss()
        value = loss(model, tokens) if loss is not None else model(tokens)
        _record(peaks, "forward", start, highest)
        losses.append(value.item())
        start = reset_peak_rss()
        value.backward()
        _record(peaks, "backward", start, highest)
        start = reset_peak_rss()
        optimizer.step()
        optimizer.zero_grad()
        _record(peaks, "step", start, highest)
    placement.close()
    largest = _largest_from_shape(shape) if build is None else max(
        unit.numel * 4 for unit in model.zero_engine.partition.units)
    return {"peak_bytes": peaks, "model_bytes": numel * 4, "losses": losses, "baseline_bytes": baseline,
            "largest_module_bytes": largest, "peak_rss_bytes": highest[0]}


def _record(peaks: dict[str, int], phase: str, start: int, highest: list[int]) -> None:
    """Keep the largest rise of ``phase``'s peak over its start, across steps, and the highest peak."""
    peak = rss_bytes()[1]
    peaks[phase] = max(peaks.get(phase, 0), peak - start)
    highest[0] = max(highest[0], peak)


def _largest_from_shape(shape: dict[str, int]) -> int:
    """fp32 bytes of the largest module of a :class:`PlainDecoder` of ``shape`` (meta build)."""
    with torch.device("meta"):
        return largest_module_bytes(PlainDecoder(**shape))


def main(argv: list[str] | None = None) -> None:
    """``python -m plait.offload_io.benchmarks.plain_decoder [--layers N] [--plain-init] --out FILE``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=FULL["layers"])
    parser.add_argument("--plain-init", action="store_true", help="sharded_init() without the placement")
    parser.add_argument("--loss-chunks", type=int, default=0,
                        help="checkpoint every block and tile the loss in this many chunks (0: neither)")
    parser.add_argument("--memory-budget", type=int, default=0,
                        help="OffloadConfig(memory_budget=BYTES) as the only offload setting (0: the fixed knobs)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--path", default=None, help="offload directory (default: a temporary one)")
    parser.add_argument("--out", required=True)
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    import torch.distributed as dist

    from plait.offload_io import IOConfig, OffloadConfig
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    config = OffloadConfig(device="nvme", param_device="nvme", grad_device="nvme", path=".",
                           sub_group_size=1 << 20, io=IOConfig(block_size=1 << 20, queue_depth=4, workers=2))
    if args.memory_budget:
        config = OffloadConfig(memory_budget=args.memory_budget, path=".")
    shape = {**FULL, "layers": args.layers}

    def build() -> PlainDecoder:
        model = PlainDecoder(**shape)
        if args.loss_chunks:
            bound_activations(model, loss_chunks=args.loss_chunks)
        return model

    with tempfile.TemporaryDirectory(dir=args.path) as root:
        result = phase_peaks(shape, root, placement_config=config, straight_to_store=not args.plain_init,
                             batch=args.batch, seq=args.seq, build=build)
    result.update(shape=shape, straight_to_store=not args.plain_init, loss_chunks=args.loss_chunks,
                  batch=args.batch, seq=args.seq, memory_budget=args.memory_budget,
                  command="python -m plait.offload_io.benchmarks.plain_decoder " + " ".join(argv),
                  load_average=os.getloadavg())
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps(result["peak_bytes"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
