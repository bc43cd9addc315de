"""``plait ckpt quantize``: weight-only int8/int4 universal checkpoints, their manifest record and refusals."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from torch import nn

import plait.universal_ckpt as uc
from plait.kernels.ops.quant_matmul import QuantScheme, quantize_weight, weight_nbytes
from plait.universal_ckpt.cli import register
from plait.universal_ckpt.errors import CheckpointExistsError, CheckpointIntegrityError, CheckpointLayoutError
from plait.universal_ckpt.quantize import CheckpointQuantizeConfig, quantize_checkpoint


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(128, 64, bias=False)
        self.down_proj = nn.Linear(96, 128, bias=True)  # 96: no int4 group of 64/128 divides it
        self.gate = nn.Linear(128, 4, bias=False)       # a router: kept
        self.norm = nn.LayerNorm(128)


class _Tiny(nn.Module):
    """HF-style names: model.embed_tokens, model.layers.0.*, lm_head."""

    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(64, 128)
        self.model.layers = nn.ModuleList([_Block()])
        self.lm_head = nn.Linear(128, 64, bias=False)


def _source(tmp_path, dtype=torch.float32):
    torch.manual_seed(0)
    model = _Tiny().to(dtype)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model.lm_head.weight.sum().backward()
    optim.step()
    uc.save({"model": model, "optim": optim, "extra": {"epoch": 1}}, tmp_path / "src", step=7)
    return model


def _read(root) -> tuple[dict[str, torch.Tensor], dict]:
    ckpt = uc.latest(root)
    manifest = uc.read_manifest(ckpt)
    return {e.name: uc.read_full(ckpt, manifest, e) for e in manifest.tensors.values()}, manifest.user_meta


@pytest.mark.parametrize("bits,group,symmetric", [(8, None, True), (4, 32, True), (4, 32, False)])
def test_quantized_checkpoint_holds_the_codes_of_the_source(tmp_path, bits, group, symmetric):
    model = _source(tmp_path)
    config = CheckpointQuantizeConfig(bits=bits, group_size=group, symmetric=symmetric, skip=("*.down_proj.weight",))
    report = quantize_checkpoint(tmp_path / "src", tmp_path / "q", config)
    tensors, meta = _read(tmp_path / "q")
    record = meta["quantization"]
    scheme = QuantScheme.from_json(record["scheme"])
    assert scheme == config.scheme and record["format"] == "plait-weight-only" and record["key"] == "model"
    assert report.quantized == ("model.layers.0.q_proj.weight",) and record["source_step"] == 7
    assert set(record["tensors"]) == {"model.layers.0.q_proj.weight"}
    assert dict(report.kept) == record["kept"] and set(record["kept"]) == {
        "lm_head.weight", "model.embed_tokens.weight", "model.layers.0.down_proj.weight", "model.layers.0.gate.weight"}
    codes, scales, zeros = quantize_weight(model.model.layers[0].q_proj.weight.detach(), scheme)
    assert torch.equal(tensors["model.layers.0.q_proj.weight_codes"], codes)
    assert torch.equal(tensors["model.layers.0.q_proj.weight_scales"], scales)
    assert ("model.layers.0.q_proj.weight_zeros" in tensors) == (not symmetric)
    if zeros is not None:
        assert torch.equal(tensors["model.layers.0.q_proj.weight_zeros"], zeros)
    assert "model.layers.0.q_proj.weight" not in tensors
    for name, value in model.state_dict().items():  # everything else bit for bit
        if name != "model.layers.0.q_proj.weight":
            assert torch.equal(tensors[name], value), name
    assert not any(n.startswith("optim") or "momentum" in n for n in tensors)  # training state is not served
    assert any(d.startswith("optim/") for d in report.dropped) and "objects" in report.dropped
    assert report.bytes_after == weight_nbytes((64, 128), scheme) and report.bytes_before == 64 * 128 * 4
    uc.verify_checkpoint(uc.latest(tmp_path / "q"))  # its own hashes


def test_head_and_embedding_on_request(tmp_path):
    _source(tmp_path, torch.bfloat16)
    config = CheckpointQuantizeConfig(bits=4, group_size=64, include_head=True, include_embedding=True,
                                      skip=("*down_proj*",))
    report = quantize_checkpoint(tmp_path / "src", tmp_path / "q", config)
    assert set(report.quantized) == {"lm_head.weight", "model.embed_tokens.weight", "model.layers.0.q_proj.weight"}
    _, meta = _read(tmp_path / "q")
    assert meta["quantization"]["tensors"]["lm_head.weight"] == {"shape": [64, 128], "dtype": "bfloat16"}


def test_bad_input_is_refused_before_any_write(tmp_path):
    _source(tmp_path)
    out = tmp_path / "q"
    with pytest.raises(ValueError, match=r"down_proj.weight: in_features=96 is not divisible by group_size=64.*--skip"):
        quantize_checkpoint(tmp_path / "src", out, CheckpointQuantizeConfig(bits=4, group_size=64))
    with pytest.raises(ValueError, match="bits=3"):
        CheckpointQuantizeConfig(bits=3)
    with pytest.raises(ValueError, match="group_size=48"):
        CheckpointQuantizeConfig(bits=4, group_size=48)
    with pytest.raises(ValueError, match="group_size=64 with bits=8"):
        CheckpointQuantizeConfig(bits=8, group_size=64)
    with pytest.raises(CheckpointLayoutError, match="no_such"):
        quantize_checkpoint(tmp_path / "src", out, CheckpointQuantizeConfig(bits=8, skip=("no_such*",)))
    assert not out.exists()
    out.mkdir()
    with pytest.raises(CheckpointExistsError, match="exists"):
        quantize_checkpoint(tmp_path / "src", out, CheckpointQuantizeConfig(bits=8))
    assert list(out.iterdir()) == []


def test_damaged_source_and_non_finite_weight_commit_nothing(tmp_path):
    model = _source(tmp_path)
    data = next((tmp_path / "src").glob("step-*/data/*.bin"))
    raw = bytearray(data.read_bytes())
    raw[3] ^= 1
    data.write_bytes(raw)
    with pytest.raises(CheckpointIntegrityError):
        quantize_checkpoint(tmp_path / "src", tmp_path / "q", CheckpointQuantizeConfig(bits=8))
    assert uc.latest(tmp_path / "q") is None
    with torch.no_grad():
        model.model.layers[0].q_proj.weight[1, 2] = float("nan")
    uc.save({"model": model}, tmp_path / "nan", step=1)
    with pytest.raises(ValueError, match="q_proj.weight: .*inf or NaN"):
        quantize_checkpoint(tmp_path / "nan", tmp_path / "q2", CheckpointQuantizeConfig(bits=8))
    assert uc.latest(tmp_path / "q2") is None


def test_quantized_checkpoint_is_refused_as_full_precision(tmp_path):
    _source(tmp_path)
    quantize_checkpoint(tmp_path / "src", tmp_path / "q", CheckpointQuantizeConfig(bits=8))
    with pytest.raises(CheckpointLayoutError, match=r"quantized int8 per channel symmetric.*quantize"):
        uc.load({"model": _Tiny()}, tmp_path / "q")
    from plait.universal_ckpt.interop.hf import export_hf

    with pytest.raises(CheckpointLayoutError, match="export_quantized_hf"):
        export_hf(tmp_path / "q", tmp_path / "hf")
    with pytest.raises(CheckpointLayoutError, match="already quantized"):
        quantize_checkpoint(tmp_path / "q", tmp_path / "qq", CheckpointQuantizeConfig(bits=8))


def test_tied_head_is_written_as_its_own_tensor_when_quantized(tmp_path):
    from plait.universal_ckpt.offline import write_offline

    torch.manual_seed(0)
    model = _Tiny()
    model.lm_head.weight = model.model.embed_tokens.weight
    state = {k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}  # stored once, as producers do
    write_offline(tmp_path / "src", step=1, tensors=[("model", k, "parameter", v) for k, v in state.items()],
                  user_meta={"tied_aliases": {"model": {"lm_head.weight": "model.embed_tokens.weight"}}})
    quantize_checkpoint(tmp_path / "src", tmp_path / "keep", CheckpointQuantizeConfig(bits=8, skip=("*down*",)))
    tensors, meta = _read(tmp_path / "keep")
    assert meta["tied_aliases"] == {"model": {"lm_head.weight": "model.embed_tokens.weight"}}
    assert "lm_head.weight" not in tensors  # still one tensor under two names
    quantize_checkpoint(tmp_path / "src", tmp_path / "head", CheckpointQuantizeConfig(bits=8, include_head=True,
                                                                                      skip=("*down*",)))
    tensors, meta = _read(tmp_path / "head")
    assert "tied_aliases" not in meta and "lm_head.weight" in meta["quantization"]["tensors"]
    codes, _, _ = quantize_weight(model.lm_head.weight.detach(), QuantScheme(kind="int8"))
    assert torch.equal(tensors["lm_head.weight_codes"], codes)
    assert torch.equal(tensors["model.embed_tokens.weight"], model.model.embed_tokens.weight)


def _plait(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="plait")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return args.func(args)


def test_cli(tmp_path, capsys):
    _source(tmp_path)
    src, out = str(tmp_path / "src"), str(tmp_path / "q")
    assert _plait("ckpt", "quantize", src, out, "--bits", "4", "--group-size", "128", "--asymmetric") == 1
    assert "in_features=96" in capsys.readouterr().err and not (tmp_path / "q").exists()
    assert _plait("ckpt", "quantize", src, out, "--bits", "8", "--group-size", "64") == 2
    assert _plait("ckpt", "quantize", src, out, "--bits", "4", "--group-size", "128", "--asymmetric",
                  "--skip", "*.down_proj.weight") == 0
    printed = capsys.readouterr().out
    assert "1 weights int4 group 128" in printed and "lm_head.weight" in printed and "optim/" in printed
    manifest = json.loads(next((tmp_path / "q").glob("step-*/manifest.json")).read_text())
    assert manifest["user_meta"]["quantization"]["scheme"] == {"kind": "int4", "group_size": 128, "symmetric": False}
    assert _plait("ckpt", "quantize", src, out, "--bits", "8") == 1  # never over an existing output
    assert "exists" in capsys.readouterr().err
    assert _plait("ckpt", "verify", out) == 0
    assert _plait("ckpt", "inspect", out) == 0
    assert "quantized: int4 group 128 asymmetric (plait-weight-only v1), 1 weights" in capsys.readouterr().out
