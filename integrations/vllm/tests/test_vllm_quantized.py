"""Weight-only quantized checkpoints served by vLLM's CPU engine with ``quantization="plait_weight_only"``.

A tiny random Llama (head_dim 64) is saved as a universal checkpoint and quantized by ``plait ckpt
quantize``: int8, exported with ``plait ckpt convert --to hf`` (compressed-tensors pack-quantized)
and served from that directory; int4 group 64 with zero points, served straight from the quantized
universal checkpoint (``load_format="plait_universal"``, config.json written by ``--config``). Both
give the greedy tokens of plait's own quantized HF model of the same weights. One engine process,
two engines; a second process serves the int4 checkpoint with ``PLAIT_VLLM_QUANT_CPU_KERNEL=plait``
(plait's own CPU kernels) and gives the tokens of plait's HF model on those kernels. Also without
vLLM: a quantized checkpoint is refused by an engine not running plait's quantization, an unknown or
unbuildable ``PLAIT_VLLM_QUANT_CPU_KERNEL`` is refused by name, and the pack-quantized parameters a
Linear gets are turned back into plait's codes run by plait's kernels.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402
from vllm.model_executor.layers.linear import LinearBase  # noqa: E402

import plait.universal_ckpt as uc  # noqa: E402
from plait.inference_kernels.quantization import QuantizeConfig, quantize  # noqa: E402
from plait.universal_ckpt.cli import register  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_testing import hf_tokens, llama_config, run_engine  # noqa: E402


def _plait(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="plait")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return args.func(args)


def _llama():

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(llama_config()).eval()


INT8 = QuantizeConfig(kind="int8", keep_original=False)
INT4 = QuantizeConfig(kind="int4", group_size=64, symmetric=False, keep_original=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The base model and its directory: train/, cfg/, int8/, int8-hf/, int4/ (with config.json)."""
    tmp = tmp_path_factory.mktemp("quantized")
    base = _llama()
    uc.save({"model": base}, tmp / "train", step=2)
    base.config.save_pretrained(tmp / "cfg")
    assert _plait("ckpt", "quantize", str(tmp / "train"), str(tmp / "int8"), "--bits", "8") == 0
    assert _plait("ckpt", "convert", str(tmp / "int8"), str(tmp / "int8-hf"), "--to", "hf",
                  "--config", str(tmp / "cfg")) == 0
    assert _plait("ckpt", "quantize", str(tmp / "train"), str(tmp / "int4"), "--bits", "4", "--group-size", "64",
                  "--asymmetric", "--config", str(tmp / "cfg")) == 0
    return base, tmp


def test_quantized_checkpoints_serve_plait_tokens(checkpoints):
    base, tmp_path = checkpoints
    want = {}
    for name, config in (("int8", INT8), ("int4", INT4)):
        model = copy.deepcopy(base)
        quantize(model, config)
        want[name] = hf_tokens(model)
    assert want["int8"] != want["int4"]  # the two schemes differ, so equality below means something
    runs = run_engine(tmp_path, "--job", f"int8={tmp_path / 'int8-hf'}@auto",
                       "--job", f"int4={tmp_path / 'int4'}@plait_universal")
    for name in ("int8", "int4"):
        assert "QuantizedLinear" in runs[name]["layers"], runs[name]["layers"]
        assert runs[name]["tokens"] == want[name], name
        assert runs[name]["quant_cpu_kernels"] == ["torch"], name
    assert runs["int4"]["load_reports"][0]["checked_bytes"] > 0  # the quantized checkpoint's chunks were checked


def test_quantized_checkpoint_served_on_plait_cpu_kernels(checkpoints):
    from plait.kernels.ops import quant_matmul_cpu

    if not quant_matmul_cpu.cpu_supported():
        pytest.skip("no AVX2 on this CPU: PLAIT_VLLM_QUANT_CPU_KERNEL=plait is refused here (tested below)")
    base, tmp_path = checkpoints
    model = copy.deepcopy(base)
    quantize(model, dataclasses.replace(INT4, cpu_kernel="plait"))
    want = hf_tokens(model)
    runs = run_engine(tmp_path, "--job", f"int4={tmp_path / 'int4'}@plait_universal", name="plait-kernels",
                      env={"PLAIT_VLLM_QUANT_CPU_KERNEL": "plait"})
    assert runs["int4"]["quant_cpu_kernels"] == ["plait"]
    assert runs["int4"]["tokens"] == want


def test_plait_cpu_kernel_setting_reaches_the_linear_method_or_is_refused(checkpoints, monkeypatch):
    from plait.kernels.ops import quant_matmul_cpu
    from plait.vllm.quantized import PlaitWeightOnlyConfig

    _, tmp_path = checkpoints
    quant = json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]
    monkeypatch.delenv("PLAIT_VLLM_QUANT_CPU_KERNEL", raising=False)
    assert PlaitWeightOnlyConfig.from_config(quant).cpu_kernel == "torch"
    monkeypatch.setenv("PLAIT_VLLM_QUANT_CPU_KERNEL", "avx")
    with pytest.raises(ValueError, match=r"PLAIT_VLLM_QUANT_CPU_KERNEL='avx' is not one of torch, plait"):
        PlaitWeightOnlyConfig.from_config(quant)
    monkeypatch.setenv("PLAIT_VLLM_QUANT_CPU_KERNEL", "plait")
    if quant_matmul_cpu.cpu_supported():
        method = PlaitWeightOnlyConfig.from_config(quant).get_quant_method(
            LinearBase.__new__(LinearBase), "model.layers.0.mlp.down_proj")
        assert method.cpu_kernel == "plait"
        _check_plait_linear(method)
    monkeypatch.setattr(quant_matmul_cpu, "available", lambda: False)
    monkeypatch.setattr(quant_matmul_cpu, "build_error", "no C++ compiler ('c++' not found; set CXX)")
    with pytest.raises(ValueError, match=r"PLAIT_VLLM_QUANT_CPU_KERNEL='plait' cannot be used here: no C\+\+ "
                                         r"compiler .*use cpu_kernel='torch'"):
        PlaitWeightOnlyConfig.from_config(quant)


def test_quantized_checkpoint_refused_without_plait_quantization(checkpoints):
    from plait.vllm.checkpoint_weights import CheckpointWeights
    from plait.vllm.loader import _quantization

    _, tmp_path = checkpoints
    weights = CheckpointWeights(tmp_path / "int4")
    with pytest.raises(ValueError, match=r"quantized int4 group 64 asymmetric.*plait_weight_only"):
        _quantization(weights, types.SimpleNamespace(quantization=None))
    assert _quantization(weights, types.SimpleNamespace(quantization="plait_weight_only"))["bits"] == 4
    quant = json.loads((tmp_path / "int4" / "config.json").read_text())["quantization_config"]
    from plait.vllm.quantized import PlaitWeightOnlyConfig

    assert PlaitWeightOnlyConfig.override_quantization_method(quant, None) == "plait_weight_only"
    assert PlaitWeightOnlyConfig.override_quantization_method(quant, "compressed-tensors") is None
    foreign = {k: v for k, v in quant.items() if k != "plait"}
    assert PlaitWeightOnlyConfig.override_quantization_method(foreign, None) is None
    assert PlaitWeightOnlyConfig.override_quantization_method(foreign, "plait_weight_only") == "plait_weight_only"


def _check_plait_linear(method) -> None:
    """The method turns loaded pack-quantized parameters into a QuantizedLinear on plait's kernels,
    which computes the torch reference's product of the same codes."""
    from plait.kernels.ops.quant_matmul import quant_matmul_reference, quantize_weight

    scheme = method.scheme
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    codes, scales, zeros = quantize_weight(weight, scheme)
    nibbles = codes.reshape(64, 16, 4)  # 8 nibbles a little-endian int32 word
    zero_words = None if zeros is None else sum(zeros.to(torch.int64).reshape(8, 8, -1)[:, j] << (4 * j)
                                               for j in range(8))
    layer = types.SimpleNamespace(
        weight_packed=torch.nn.Parameter(nibbles.view(torch.int32).reshape(64, 16), requires_grad=False),
        weight_scale=torch.nn.Parameter(scales, requires_grad=False),
        weight_shape=torch.tensor([64, 128]), plait_shape=(64, 128), plait_dtype=torch.float32)
    if zero_words is not None:
        layer.weight_zero_point = torch.nn.Parameter(zero_words.to(torch.int32), requires_grad=False)
    method.process_weights_after_loading(layer)
    assert layer.plait_weight.cpu_kernel == "plait" and layer.plait_weight._own
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(method.apply(layer, x), quant_matmul_reference(x, codes, scales, zeros, scheme),
                               atol=1e-4, rtol=1e-4)
