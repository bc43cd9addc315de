"""Every route that writes consolidated weights of a sharded model keeps every tied name.

One 2-rank gloo session shards two models with tied heads under ZeRO-3, an HF GPT-2 with
``tie_word_embeddings=True`` (``lm_head.weight`` is ``transformer.wte.weight``) and a small torch
GPT (``head.weight`` is ``wte.weight``), and writes them through:

* the HF Trainer's ``save_model`` (``plait.transformers.checkpoint.export_pretrained``);
* ``uc.save`` of the sharded model, then ``export_hf`` and ``plait ckpt convert --to hf``;
* Fabric's save (the plait Fabric strategy's checkpoint view and directory save), then
  ``plait.lightning.consolidated_state_dict`` and ``export_weights``.

Each result must load into the unsharded model with ``load_state_dict(strict=True)`` and hold
bitwise its values (the models are saved before any step, so the unsharded model is the oracle).
"""

from __future__ import annotations

import argparse
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")
pytest.importorskip("lightning")

from plait.kernels.testing import run_distributed


class TiedGPT(nn.Module):
    """Embedding, one MLP block and a head sharing the embedding's weight."""

    def __init__(self, vocab: int = 64, dim: int = 16) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.block = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids)
        return self.head(x + self.block(x))


def _hf_model() -> Any:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2, tie_word_embeddings=True)
    return GPT2LMHeadModel(config).eval()


def _torch_model() -> TiedGPT:
    torch.manual_seed(1)
    return TiedGPT()


def session(root: str) -> None:
    """Every rank shards and saves; rank 0 writes the consolidated outputs."""
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    import plait.universal_ckpt as uc
    from plait.lightning import fabric as plait_fabric
    from plait.lightning.checkpoint import save_directory
    from plait.transformers.checkpoint import export_pretrained
    from plait.zero_sharding import ZeroConfig, zero_shard

    hf, _ = zero_shard(_hf_model(), torch.optim.SGD, ZeroConfig(stage=3), lr=0.1)
    export_pretrained(f"{root}/save_model", hf)  # what Trainer.save_model runs under plait ZeRO
    uc.save({"model": hf}, f"{root}/uc", step=1).wait()
    gpt, optimizer = zero_shard(_torch_model(), torch.optim.AdamW, ZeroConfig(stage=3), lr=0.1)
    # the plait Fabric strategy's save_checkpoint body: its checkpoint view, then the directory save
    save_directory(f"{root}/fabric.ckpt", plait_fabric._for_checkpoint({"model": gpt, "optimizer": optimizer}),
                   step=0)
    dist.barrier()
    if dist.get_rank() == 0:
        from plait.universal_ckpt import cli
        from plait.universal_ckpt.interop.hf import export_hf

        export_hf(uc.latest(f"{root}/uc"), f"{root}/export_hf", key="model")
        assert cli.run_convert(argparse.Namespace(src=f"{root}/uc", dst=f"{root}/convert", to="hf",
                                                  dtype=None, key="model")) == 0


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tied_routes")
    run_distributed(session, 2, str(path), timeout=240)
    return path


def _safetensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        out.update(load_file(file))
    return out


def _strict_and_bitwise(state: dict[str, torch.Tensor], reference: nn.Module) -> None:
    expected = reference.state_dict()
    assert sorted(state) == sorted(expected)
    fresh = type(reference)(reference.config) if hasattr(reference, "config") else type(reference)()
    result = fresh.load_state_dict(state, strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for name, value in expected.items():
        assert state[name].dtype == value.dtype and torch.equal(state[name], value), name


@pytest.mark.parametrize("route", ["save_model", "export_hf", "convert"])
def test_hf_tied_model_routes_strict_and_bitwise(root: Path, route: str) -> None:
    reference = _hf_model()
    assert "lm_head.weight" in reference.state_dict()
    _strict_and_bitwise(_safetensors(root / route), reference)


def test_fabric_save_consolidates_and_exports_every_name(root: Path, tmp_path: Path) -> None:
    from plait.lightning import consolidated_state_dict, export_weights

    reference = _torch_model()
    assert "head.weight" in reference.state_dict()
    _strict_and_bitwise(consolidated_state_dict(root / "fabric.ckpt"), reference)
    _strict_and_bitwise(_safetensors(export_weights(root / "fabric.ckpt", tmp_path / "out")), reference)
