"""Weight-only quantized checkpoints served by vLLM's CPU engine with ``quantization="plait_weight_only"``.

A tiny random Llama (head_dim 64) is saved as a universal checkpoint and quantized by ``plait ckpt
quantize``: int8, exported with ``plait ckpt convert --to hf`` (compressed-tensors pack-quantized)
and served from that directory; int4 group 64 with zero points, served straight from the quantized
universal checkpoint (``load_format="plait_universal"``, config.json written by ``--config``). Both
give the greedy tokens of plait's own quantized HF model of the same weights. One engine process,
two engines. Also without vLLM: a quantized checkpoint is refused by an engine not running plait's
quantization, and the pack-quantized parameters a Linear gets are turned back into plait's codes.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

pytest.importorskip("vllm")
transformers = pytest.importorskip("transformers")

import torch  # noqa: E402

import plait.universal_ckpt as uc  # noqa: E402
from plait.inference_kernels.quantization import QuantizeConfig, quantize  # noqa: E402
from plait.universal_ckpt.cli import register  # noqa: E402

RUNNER = Path(__file__).with_name("vllm_engine_run.py")
PROMPTS = [[1, 17, 42, 99, 5], [7, 7, 300, 12], [250, 3]]  # as in vllm_engine_run.py
NEW_TOKENS = 12


def _plait(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="plait")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return args.func(args)


def _run_engine(tmp: Path, *args: str) -> dict:
    out = tmp / "engine.json"
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    result = subprocess.run([sys.executable, str(RUNNER), *args, "--out", str(out)], capture_output=True, text=True,
                            env=env, timeout=400, cwd=tmp)
    if result.returncode or not out.is_file():
        pytest.fail(f"engine run failed (rc {result.returncode}):\n{(result.stdout + result.stderr)[-5000:]}")
    return json.loads(out.read_text())


def _llama():
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                      max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _hf_tokens(model) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                                 min_new_tokens=NEW_TOKENS, do_sample=False)
            out.append(gen[0, len(prompt):].tolist())
    return out


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
        want[name] = _hf_tokens(model)
    assert want["int8"] != want["int4"]  # the two schemes differ, so equality below means something
    runs = _run_engine(tmp_path, "--job", f"int8={tmp_path / 'int8-hf'}@auto",
                       "--job", f"int4={tmp_path / 'int4'}@plait_universal")
    for name in ("int8", "int4"):
        assert "QuantizedLinear" in runs[name]["layers"], runs[name]["layers"]
        assert runs[name]["tokens"] == want[name], name
    assert runs["int4"]["load_reports"][0]["checked_bytes"] > 0  # the quantized checkpoint's chunks were checked


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
