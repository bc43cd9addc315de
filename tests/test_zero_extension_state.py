"""A ZeRO extension's own tensors (a reducer's per-parameter state, as 1-bit error feedback)
saved through ``ZeroModule.sharded_state_dict`` at 4 ranks and restored at 2 by
plait-universal-ckpt."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from plait.kernels import collectives
from plait.kernels.sharded_state import ShardedTensor, ShardSpec
from plait.kernels.testing import run_distributed, tiny_llama

universal_ckpt = pytest.importorskip("plait.universal_ckpt")
from plait.zero_sharding import DefaultReducer, ZeroConfig, zero_shard  # noqa: E402


class SummingReducer(DefaultReducer):
    """Keeps the running sum of every reduced gradient shard: state that lives only in the
    reducer and is laid out like the masters (one flat slice per unit)."""

    def bind(self, engine: Any) -> None:
        self.engine = engine
        self.sums = {u.key: torch.zeros(u.shard_numel) for u in engine.units}

    def reduce_scatter(self, full: torch.Tensor, shard_out: torch.Tensor, *, group: Any, key: str) -> None:
        collectives.reduce_scatter_tensor(shard_out, full, group=group)
        self.sums[key] += shard_out

    def sharded_state_dict(self) -> dict[str, ShardedTensor]:
        out = {}
        for unit in self.engine.units:
            for slot, (plo, phi), (slo, shi) in unit.local_pieces():
                name = f"ext.sums.{slot.name}"
                spec = ShardSpec(name=name, kind="optimizer_state", dtype=torch.float32, global_shape=slot.shape,
                                 flat_range=(plo, phi), replica_ranks=(dist.get_rank(),))
                out[name] = ShardedTensor(spec, self.sums[unit.key][slo:shi])
        return out

    def full_sums(self) -> dict[str, torch.Tensor]:
        """Every parameter's whole running sum (collective)."""
        out = {}
        for unit in self.engine.units:
            whole = torch.empty(unit.padded_numel)
            collectives.all_gather_into_tensor(whole, self.sums[unit.key], group=unit.group)
            for slot in unit.slots:
                out[slot.name] = whole[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
        return out


def _model_and_reducer() -> tuple[Any, Any, SummingReducer]:
    torch.manual_seed(0)
    reducer = SummingReducer()
    model, optimizer = zero_shard(tiny_llama(num_layers=2, hidden_size=32, num_heads=2, vocab_size=64),
                                  torch.optim.AdamW, ZeroConfig(stage=2, reduce_bucket_elements=4_000),
                                  reducer=reducer, lr=1e-3)
    return model, optimizer, reducer


def _save(path: str) -> dict[str, torch.Tensor]:
    model, optimizer, reducer = _model_and_reducer()
    for step in range(2):
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    universal_ckpt.save({"model": model}, path, step=2)
    return reducer.full_sums()


def _load(path: str) -> dict[str, torch.Tensor]:
    model, _optimizer, reducer = _model_and_reducer()
    universal_ckpt.load({"model": model}, path)
    return reducer.full_sums()


def test_reducer_state_saved_at_4_restored_at_2(tmp_path):
    saved = run_distributed(_save, 4, str(tmp_path), timeout=120)[0]
    restored = run_distributed(_load, 2, str(tmp_path), timeout=120)[0]
    assert saved.keys() == restored.keys() and any(v.abs().sum() > 0 for v in saved.values())
    for name, value in saved.items():
        assert torch.equal(restored[name], value), name
