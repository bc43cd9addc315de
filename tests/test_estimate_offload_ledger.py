"""``plait estimate``'s offload rows against what a run with plait-offload-io holds (W=2).

For ZeRO-2 and ZeRO-3 with ``OffloadConfig(device="cpu")`` (the ``optimizer`` rows) and ZeRO-3
with ``param_device="cpu"`` too (the ``all`` row), in bf16 and fp32, a tiny Llama trains two steps;
after the second backward (gradients reduced, optimizer state allocated by the first step) each
rank's holdings are read from the memory ledger and the placement:

* device: the parameters the ZeRO units keep (``model_state_bytes()["params"]``);
* host: the fp32 masters, the optimizer state and the reduced gradient shards (the ledger's
  ``master``, ``optimizer`` and ``grads``: plait-offload-io keeps them in host memory), plus the
  parameter shards the placement's shard storage holds between gathers.

On a CPU-only machine device and host are the same memory; what is checked is where plait puts
each kind, which is what the GPU split follows. ``param_persistence_threshold=0`` so that stage 3
shards every parameter, as the formula assumes; shard padding and step counters are the only
differences, well inside the 2% allowed.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("plait.offload_io")
pytest.importorskip("plait.zero_sharding")

from plait.kernels.testing import run_distributed, tiny_llama

MODEL = dict(num_layers=2, hidden_size=64, num_heads=2, intermediate_size=96, vocab_size=300)
CASES = [(2, "optimizer", torch.bfloat16), (3, "optimizer", torch.bfloat16), (3, "all", torch.bfloat16),
         (2, "optimizer", torch.float32), (3, "all", torch.float32)]
TOLERANCE = 0.02


def _holdings(stage: int, offload: str, dtype: torch.dtype) -> dict[str, int]:
    from plait.offload_io import OffloadConfig, zero_placement
    from plait.zero_sharding import ZeroConfig, zero_shard
    from plait.zero_sharding.memory import model_state_bytes

    torch.manual_seed(0)
    model = tiny_llama(**MODEL)
    psi = sum(p.numel() for p in model.parameters())
    placement = zero_placement(OffloadConfig(device="cpu", param_device="cpu" if offload == "all" else "none"))
    config = ZeroConfig(stage=stage, compute_dtype=dtype, param_persistence_threshold=0)
    model, optimizer = zero_shard(model, torch.optim.AdamW, config, placement=placement, lr=1e-3)
    ids = torch.randint(0, MODEL["vocab_size"], (2, 16))
    for step in range(2):
        model(ids, labels=ids).loss.backward()
        if step == 0:
            optimizer.step()
            optimizer.zero_grad()
    held = model_state_bytes(model)
    storage = placement.shard_storage()
    param_shards = storage.resident_bytes if storage is not None else 0
    placement.close()
    return {"psi": psi, "device": held["params"],
            "host": held["master"] + held["optimizer"] + held["grads"] + param_shards}


def offload_holdings() -> list[dict[str, int]]:
    """Every case on this rank (one process group for all: start-up dominates on 2 cores)."""
    return [_holdings(*case) for case in CASES]


@pytest.mark.timeout(300)
def test_estimate_offload_rows_are_what_an_offloaded_run_holds():
    from plait.zero_sharding.estimate import estimate

    per_rank = run_distributed(offload_holdings, 2, timeout=240)
    for (stage, offload, dtype), *ranks in zip(CASES, *per_rank):
        psi = ranks[0]["psi"]
        row = next(r for r in estimate(psi, world_sizes=[2], dtype=dtype) if (r.stage, r.offload) == (stage, offload))
        for rank, held in enumerate(ranks):
            where = f"stage {stage}, offload={offload}, {dtype}, rank {rank}"
            print(f"{where}: device {held['device']} vs {row.device_bytes:.0f}, "
                  f"host {held['host']} vs {row.host_bytes:.0f}")
            assert held["device"] == pytest.approx(row.device_bytes, rel=TOLERANCE, abs=0), where
            assert held["host"] == pytest.approx(row.host_bytes, rel=TOLERANCE), where
