"""``zero_shard``'s ``state_dict`` carries every name of a tied tensor, as ``nn.Module.state_dict``.

An HF GPT-2 with ``tie_word_embeddings=True`` (``lm_head.weight`` is ``transformer.wte.weight``)
trains two SGD steps on 2 gloo ranks under ZeRO-2 and ZeRO-3 and, as the reference, under DDP.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")  # the tied model is HF's GPT-2

from plait.kernels.testing import run_distributed
from plait.zero_sharding import ZeroConfig, zero_shard


def _model() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, tie_word_embeddings=True)
    return GPT2LMHeadModel(config).eval()  # eval: no dropout, so every run sees the same function


def _train(model: Any, optimizer: Any) -> None:
    rank = dist.get_rank()
    for step in range(2):
        ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(step))[rank * 2:rank * 2 + 2]
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def session() -> dict[Any, Any]:
    """Rank 0 returns DDP's state dict and, per stage, what the sharded model gave and took."""
    reference = _model()
    names = list(reference.state_dict())
    ddp = torch.nn.parallel.DistributedDataParallel(reference)
    _train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.5))
    out: dict[Any, Any] = {"names": names, "ddp": reference.state_dict()}
    for stage in (2, 3):  # one launch for both (process start-up and imports dominate on 2 cores)
        out[stage] = _stage(stage, reference.state_dict())
    return out


def _stage(stage: int, reference: dict[str, torch.Tensor]) -> dict[str, Any]:
    sharded, optimizer = zero_shard(_model(), torch.optim.SGD, ZeroConfig(stage=stage), lr=0.5)
    _train(sharded, optimizer)
    state = sharded.state_dict()
    fresh = _model()
    loaded = fresh.load_state_dict(state, strict=True)
    sharded.load_state_dict(reference, strict=True)  # every name accepted back
    return {"state": state, "loaded": loaded, "still_tied": fresh.lm_head.weight is fresh.transformer.wte.weight}


@pytest.fixture(scope="module")
def runs() -> dict[Any, Any]:
    return run_distributed(session, 2, timeout=240)[0]


@pytest.mark.parametrize("stage", [2, 3])
def test_state_dict_has_every_name_and_strict_loads(runs: dict[Any, Any], stage: int) -> None:
    out = {**runs, **runs[stage]}
    assert "lm_head.weight" in out["names"] and "transformer.wte.weight" in out["names"]
    assert sorted(out["state"]) == sorted(out["names"])
    assert not out["loaded"].missing_keys and not out["loaded"].unexpected_keys and out["still_tied"]
    assert torch.equal(out["state"]["lm_head.weight"], out["state"]["transformer.wte.weight"])
    for name, value in out["ddp"].items():
        torch.testing.assert_close(out["state"][name], value, rtol=1e-5, atol=1e-6, msg=name)
