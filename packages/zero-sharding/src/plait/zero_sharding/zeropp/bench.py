"""ZeRO++ benchmark rows: logical bytes per step against plain stage 3, and the hpZ memory cost.

``run(quick)`` follows the ``plait.benchmarks`` convention (``module:run`` returning
:class:`plait.kernels.bench.BenchRow` rows), so the zero-sharding suite can include these rows or
register this module under its own name. Each world size is one :func:`run_distributed` call in
which every rank trains tiny-llama under ZeRO stage 3 twice, alternating nothing but the policies:
the engine's exact defaults, then :func:`~plait.zero_sharding.zeropp.make_zeropp_policies`. Bytes
come from the byte ledger (deterministic), so no timing is involved and world size 4 is as
meaningful as 2 (shared/benchmarks.md: on CPU, world sizes above 2 are for bytes and memory only).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.kernels.bench import BenchRow
from plait.kernels.collectives import ByteLedger
from plait.kernels.testing import global_batch, rank_slice, run_distributed, tiny_llama
from plait.zero_sharding.zeropp.config import ZeroPPConfig, make_zeropp_policies

TARGET = 0.35
# quick: the 2-layer test model; full: the shared benchmark model (tiny-llama, ~8.4M parameters).
QUICK_MODEL = dict(num_layers=2, hidden_size=64, num_heads=2, intermediate_size=96, vocab_size=300, max_seq_len=64)
FULL_MODEL: dict = {}
WARMUP_STEPS, MEASURED_STEPS = 1, 3
BATCH, SEQ = 8, 32


def _model(quick: bool) -> torch.nn.Module:
    torch.manual_seed(0)
    return tiny_llama(**(QUICK_MODEL if quick else FULL_MODEL))


def _bytes_per_step(quick: bool, policies: tuple | None) -> tuple[float, float, int]:
    """Train a few steps; returns (ledger bytes per measured step, last loss, hpZ secondary bytes)."""
    from plait.zero_sharding import ZeroConfig, zero_shard  # the engine, imported only when run

    rank, world = dist.get_rank(), dist.get_world_size()
    gatherer, reducer = policies if policies is not None else (None, None)
    config = ZeroConfig(stage=3, param_persistence_threshold=0, reduce_dtype=torch.float32)
    model, optimizer = zero_shard(_model(quick), torch.optim.AdamW, config, gatherer=gatherer, reducer=reducer,
                                  lr=1e-3)
    ledger = ByteLedger()
    loss = torch.zeros(())
    for step in range(WARMUP_STEPS + MEASURED_STEPS):
        if step == WARMUP_STEPS:
            ledger.__enter__()
        loss = model(**rank_slice(global_batch(step, BATCH, SEQ), rank, world)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    ledger.__exit__(None, None, None)
    secondary = gatherer.secondary_nbytes() if hasattr(gatherer, "secondary_nbytes") else 0
    return ledger.volume() / MEASURED_STEPS, loss.item(), secondary


def _rank(quick: bool, partition: int) -> dict:
    plain, plain_loss, _ = _bytes_per_step(quick, None)
    config = ZeroPPConfig(hierarchical_partition_size=partition)
    zeropp, zeropp_loss, secondary = _bytes_per_step(quick, make_zeropp_policies(config, None))
    psi = sum(p.numel() for p in _model(quick).parameters())
    return {"plain": plain, "zeropp": zeropp, "psi": psi, "secondary": secondary,
            "plain_loss": plain_loss, "zeropp_loss": zeropp_loss}


def run(quick: bool) -> list[BenchRow]:
    """ZeRO++ rows at world size 2 (quick) or 2 and 4 (hpZ partition 2: two ranks per "node").

    Args:
        quick: the 2-layer test model at world size 2 (about 20 s on 2 cores) instead of
            tiny-llama at world sizes 2 and 4 (a few minutes).

    Returns:
        Per world size: bytes/step vs plain stage 3 (target <= 0.35), and the hpZ secondary
        shard's bytes per rank vs the formula ``Psi / k x (1 + 4 / block)``.
    """
    rows = []
    name = "tiny-llama(2 layers)" if quick else "tiny-llama"
    for world in (2,) if quick else (2, 4):
        result = run_distributed(_rank, world, quick, 2, timeout=300 if quick else 600)[0]
        ratio = result["zeropp"] / result["plain"]
        rows.append(BenchRow(
            benchmark=f"ZeRO++ (qwZ int8 + qgZ int4 + hpZ k=2) stage 3 {name} fp32 W={world}",
            figure="logical bytes/step", ours=result["zeropp"], peer="plait stage 3 (exact)",
            peer_value=result["plain"], ratio=ratio, target=f"<= {TARGET}", passed=ratio <= TARGET,
            note=f"Psi={result['psi']}; last loss {result['zeropp_loss']:.4f} vs exact {result['plain_loss']:.4f}",
        ))
        formula = result["psi"] / 2 * (1 + 4 / 256)
        rows.append(BenchRow(
            benchmark=f"hpZ secondary shard {name} W={world} k=2", figure="bytes/rank", ours=result["secondary"],
            peer="formula Psi/k x (1 + 4/256)", peer_value=formula, ratio=result["secondary"] / formula,
            target="<= 1.02", passed=result["secondary"] / formula <= 1.02,
            note="int8 codes + fp32 scales kept from the forward gather; padding to the group size included",
        ))
    return rows
