"""A universal checkpoint quantized by ``plait ckpt quantize`` and exported with ``plait ckpt convert --to hf``
(compressed-tensors pack-quantized) rebuilds, through ``load_quantized_pretrained``, the model plait's
in-memory quantization makes of the same weights: the same buffers bit for bit and the same 16 greedy
tokens. The quantized universal checkpoint also loads with ``uc.load`` into that in-memory model.
"""

from __future__ import annotations

import argparse
import copy
import json

import pytest

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import torch  # noqa: E402

import plait.universal_ckpt as uc  # noqa: E402
from plait.inference_kernels.quantization import QuantizeConfig, quantize  # noqa: E402
from plait.inference_kernels.quantization.pretrained import load_quantized_pretrained  # noqa: E402
from plait.universal_ckpt.cli import register  # noqa: E402

NEW_TOKENS = 16


def _plait(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="plait")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(list(argv))
    return args.func(args)


@pytest.fixture(scope="module")
def llama():
    return _llama()


def _llama():
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                                      max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.2,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval()


def _tokens(model) -> list[int]:
    ids = torch.tensor([[1, 17, 42, 99, 5]])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("args,config", [
    (("--bits", "8"), QuantizeConfig(kind="int8", keep_original=False)),
    (("--bits", "4", "--group-size", "32", "--asymmetric", "--include-head"),
     QuantizeConfig(kind="int4", group_size=32, symmetric=False, head=True, keep_original=False)),
])
def test_quantized_checkpoint_to_hf_and_back(tmp_path, llama, args, config):
    base = llama
    uc.save({"model": base}, tmp_path / "train", step=3)
    assert _plait("ckpt", "quantize", str(tmp_path / "train"), str(tmp_path / "q"), *args) == 0
    ours = copy.deepcopy(base)
    quantize(ours, config)
    want = _tokens(ours)

    into = copy.deepcopy(base)
    quantize(into, config)
    with torch.no_grad():
        for buffer in into.buffers():
            buffer.zero_()
    uc.load({"model": into}, tmp_path / "q")  # the universal checkpoint into the in-memory quantized model
    for (name, a), b in zip(ours.state_dict().items(), into.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    base.config.save_pretrained(tmp_path / "cfg")
    assert _plait("ckpt", "convert", str(tmp_path / "q"), str(tmp_path / "hf"), "--to", "hf", "--config",
                  str(tmp_path / "cfg")) == 0
    quant = json.loads((tmp_path / "hf" / "config.json").read_text())["quantization_config"]
    assert quant["format"] == "pack-quantized" and quant["plait"]["scheme"] == config.scheme.to_json()
    assert ("lm_head" in quant["ignore"]) == (not config.head)
    reloaded = load_quantized_pretrained(tmp_path / "hf")
    for (name, a), b in zip(ours.state_dict().items(), reloaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    assert _tokens(reloaded) == want
    _check_plait_cpu_kernel(tmp_path / "hf", reloaded)


def _check_plait_cpu_kernel(directory, reference) -> None:
    """``load_quantized_pretrained(cpu_kernel="plait")`` runs plait's own CPU kernels on the same codes:
    the same buffers, and logits within fp32 summation-order error of the torch path's."""
    from plait.inference_kernels.quantization import QuantizedLinear
    from plait.kernels.ops import quant_matmul_cpu

    if not quant_matmul_cpu.cpu_supported():
        return  # no AVX2: "plait" is refused here (test_load_quantized_pretrained_refuses_bad_cpu_kernel)
    fast = load_quantized_pretrained(directory, cpu_kernel="plait")
    linears = [m for m in fast.modules() if isinstance(m, QuantizedLinear)]
    assert linears and all(m.cpu_kernel == "plait" and m._own for m in linears)
    for (name, a), b in zip(reference.state_dict().items(), fast.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for tokens in (3, 40):  # the register GEMV (decode), then the blocked dequantize + GEMM (prefill)
        ids = torch.randint(0, 512, (2, tokens), generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            torch.testing.assert_close(fast(input_ids=ids).logits, reference(input_ids=ids).logits,
                                       atol=1e-4, rtol=1e-4)


def test_load_quantized_pretrained_refuses_bad_cpu_kernel(tmp_path, llama, monkeypatch):
    """A cpu_kernel that cannot run is refused by name before any file is read (cfg/ is not even quantized)."""
    from plait.kernels.ops import quant_matmul_cpu

    llama.config.save_pretrained(tmp_path / "cfg")
    with pytest.raises(ValueError, match=r"load_quantized_pretrained\(cpu_kernel\)='avx' is not supported"):
        load_quantized_pretrained(tmp_path / "cfg", cpu_kernel="avx")
    monkeypatch.setattr(quant_matmul_cpu, "available", lambda: False)
    monkeypatch.setattr(quant_matmul_cpu, "build_error", "no C++ compiler ('c++' not found; set CXX)")
    with pytest.raises(ValueError, match=r"load_quantized_pretrained\(cpu_kernel\)='plait' cannot be used here: "
                                         r"no C\+\+ compiler"):
        load_quantized_pretrained(tmp_path / "cfg", cpu_kernel="plait")


def test_quantized_export_refusals(tmp_path, llama):
    base = llama
    uc.save({"model": base}, tmp_path / "train", step=1)
    assert _plait("ckpt", "quantize", str(tmp_path / "train"), str(tmp_path / "q"), "--bits", "8",
                  "--include-embedding") == 0
    base.config.save_pretrained(tmp_path / "cfg")
    from plait.universal_ckpt.errors import CheckpointLayoutError
    from plait.universal_ckpt.interop.hf_quantized import export_quantized_hf

    with pytest.raises(CheckpointLayoutError, match="embed_tokens.weight is quantized.*--include-embedding"):
        export_quantized_hf(tmp_path / "q", tmp_path / "hf", config=base.config)
    assert not (tmp_path / "hf").exists()
    with pytest.raises(CheckpointLayoutError, match="not weight-only quantized"):
        export_quantized_hf(tmp_path / "train", tmp_path / "hf")
    assert _plait("ckpt", "quantize", str(tmp_path / "train"), str(tmp_path / "q8"), "--bits", "8") == 0
    with pytest.raises(CheckpointLayoutError, match="needs the model's HF config"):
        export_quantized_hf(tmp_path / "q8", tmp_path / "hf")
    with pytest.raises(ValueError, match="no quantization_config"):
        load_quantized_pretrained(tmp_path / "cfg")
