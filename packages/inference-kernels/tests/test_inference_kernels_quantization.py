"""Weight-only quantization of HF models: parity with the same model holding the dequantized
weights (fake quantization), exact revert, the context manager, the report's byte formula, and
refusals that leave the model unchanged."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from plait.inference_kernels.patching import PatchConfig, UnsupportedModelError, patched  # noqa: E402
from plait.inference_kernels.quantization import (  # noqa: E402
    QuantizeConfig,
    QuantizedEmbedding,
    QuantizedExperts,
    QuantizedLinear,
    is_quantized,
    quantize,
    quantize_report,
    quantized,
    revert,
)
from plait.kernels.ops.quant_matmul import weight_nbytes  # noqa: E402
from plait.kernels.testing.parity import state_digest  # noqa: E402
from plait.kernels.tolerances import tolerance  # noqa: E402

COMMON = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=256,
              num_hidden_layers=2, vocab_size=256)


def build(family: str, dtype=torch.float32, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    kw = {**COMMON, **overrides}
    if family == "llama":
        config = transformers.LlamaConfig(**kw)
    elif family == "mixtral":
        config = transformers.MixtralConfig(**kw, num_experts_per_tok=2, num_local_experts=4)
    else:
        config = transformers.Qwen3MoeConfig(**{"num_experts_per_tok": 2, "num_experts": 4, "moe_intermediate_size": 64,
                                                "mlp_only_layers": [1], **kw})
    return transformers.AutoModelForCausalLM.from_config(config).eval().to(dtype)


def fake_quantized(model, report):
    """A copy of the unquantized model whose quantized layers hold the dequantized weights."""
    ref = copy.deepcopy(model)
    revert(ref)  # the copy's state keeps the originals; put them back, then overwrite their weights
    with torch.no_grad():
        for name in report.quantized:
            quant, twin = model.get_submodule(name), ref.get_submodule(name)
            if isinstance(quant, QuantizedExperts):  # transformers' own experts on the dequantized weights
                gate_up, down = quant.dequantized_weights()
                twin.gate_up_proj.copy_(gate_up)
                twin.down_proj.copy_(down)
            else:
                twin.weight.copy_(quant.dequantized_weight())
    return ref


PROMPT = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))

CONFIGS = [
    QuantizeConfig(kind="int8"),
    QuantizeConfig(kind="int4", group_size=64, head=True),
    QuantizeConfig(kind="int4", group_size=32, symmetric=False, embedding=True),
    QuantizeConfig(kind="fp6"),
]


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "mixtral"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.kind}-g{c.group_size}-{c.symmetric}")
def test_quantized_model_matches_its_fake_quantized_twin(family, config):
    model = build(family)
    with torch.no_grad():
        exact = model(PROMPT).logits
    report = quantize(model, config)
    assert report.family == family and report.quantized
    ref = fake_quantized(model, report)
    with torch.no_grad():
        got, want = model(PROMPT).logits, ref(PROMPT).logits
    # Per layer the paths differ like quant_matmul_cpu fp32 (or not at all on the reference
    # path); two layers and a softmax-free logit readout keep it within 10x that entry's atol.
    tol = tolerance("quant_matmul_cpu", torch.float32)
    torch.testing.assert_close(got, want, atol=10 * tol.atol, rtol=10 * tol.rtol)
    assert not torch.equal(got, exact)  # the weights did change
    names = dict(model.named_modules())
    assert all(isinstance(names[n], QuantizedLinear | QuantizedEmbedding | QuantizedExperts)
               for n in report.quantized)
    assert ("lm_head" in report.quantized) == config.head
    assert ("model.embed_tokens" in report.quantized) == config.embedding
    if family != "llama":  # fused experts quantized; routers (a bare weight, not a Linear) kept and said so
        assert any(isinstance(names[n], QuantizedExperts) for n in report.quantized)
        assert any(".gate.weight" in name and "not a Linear" in why for name, why in report.kept)


@pytest.mark.parametrize(("family", "dtype", "kind"), [("llama", torch.float32, "int4"),
                                                      ("qwen3_moe", torch.float32, "int4"),
                                                      ("qwen3_moe", torch.bfloat16, "int8")])
def test_greedy_tokens_equal_the_fake_quantized_model(family, dtype, kind):
    # bf16 int4 is left out on purpose: torch's CPU int4 kernel takes bf16 scales, so a random
    # model's near-tied logits can flip a token against the fp32-scale twin (seen on qwen3_moe).
    model = build(family, dtype=dtype)
    report = quantize(model, QuantizeConfig(kind=kind, group_size=64 if kind == "int4" else None))
    ref = fake_quantized(model, report)
    with torch.no_grad():
        out = model.generate(PROMPT[:1], max_new_tokens=32, do_sample=False)
        want = ref.generate(PROMPT[:1], max_new_tokens=32, do_sample=False)
    assert torch.equal(out, want)


def test_revert_restores_exactly_and_is_idempotent():
    model = build("qwen3_moe")
    digest = state_digest(model.state_dict())
    config = QuantizeConfig(kind="int4", group_size=64, head=True, embedding=True)  # experts too
    report = quantize(model, config)
    assert quantize(model, config) is report and quantize_report(model) is report and is_quantized(model)
    with pytest.raises(ValueError, match="already quantized with another QuantizeConfig"):
        quantize(model, QuantizeConfig(kind="int8"))
    assert revert(model) and not revert(model) and not is_quantized(model)
    assert state_digest(model.state_dict()) == digest
    with quantized(model, QuantizeConfig(kind="int8")) as r:
        assert is_quantized(model) and r.quantized
    assert state_digest(model.state_dict()) == digest and not is_quantized(model)


def test_revert_without_originals_gives_dequantized_linears():
    model = build("llama")
    report = quantize(model, QuantizeConfig(kind="int8", keep_original=False))
    deq = {n: model.get_submodule(n).dequantized_weight() for n in report.quantized}
    revert(model)
    for name, w in deq.items():
        assert type(model.get_submodule(name)) is torch.nn.Linear
        assert torch.equal(model.get_submodule(name).weight, w)


def test_report_bytes_follow_the_formula_and_state_dict_holds_codes():
    model = build("llama", dtype=torch.bfloat16)
    config = QuantizeConfig(kind="int4", group_size=64, symmetric=False)
    shapes = {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
              and n != "lm_head"}
    report = quantize(model, config)
    assert report.bytes_before == sum(2 * a * b for a, b in shapes.values())
    assert report.bytes_after == sum(weight_nbytes(s, config.scheme) for s in shapes.values())
    sd = model.state_dict()
    stored = sum(sd[f"{n}.weight_{k}"].numel() * sd[f"{n}.weight_{k}"].element_size()
                 for n in shapes for k in ("codes", "scales", "zeros"))
    assert stored == report.bytes_after and "model.layers.0.mlp.down_proj.weight" not in sd


def test_skip_patterns_keep_layers_and_bad_patterns_are_refused():
    model = build("llama")
    report = quantize(model, QuantizeConfig(kind="int8", skip=("*.down_proj",)))
    assert not any(n.endswith("down_proj") for n in report.quantized)
    assert type(model.model.layers[0].mlp.down_proj) is torch.nn.Linear
    revert(model)
    with pytest.raises(ValueError, match=r"skip pattern\(s\) \['\*.nothing'\] match no Linear"):
        quantize(model, QuantizeConfig(kind="int8", skip=("*.nothing",)))


def test_bad_input_is_refused_naming_the_layer_before_any_change():
    # intermediate 96: down_proj has in_features 96, which group 64 does not divide
    model = build("llama", intermediate_size=96)
    digest = state_digest(model.state_dict())
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.down_proj: in_features=96 is not divisible by "
                                         r"group_size=64"):
        quantize(model, QuantizeConfig(kind="int4", group_size=64))
    assert not is_quantized(model) and state_digest(model.state_dict()) == digest
    assert all(type(m) is not QuantizedLinear for m in model.modules())
    with pytest.raises(ValueError, match="group_size=48"):
        QuantizeConfig(kind="int4", group_size=48)
    with pytest.raises(ValueError, match="weight dtype torch.float64"):
        quantize(build("llama").to(torch.float64))
    with pytest.raises(UnsupportedModelError):
        quantize(transformers.AutoModelForCausalLM.from_config(transformers.GPT2Config(n_layer=1, n_embd=64,
                                                                                          n_head=2)))
    patched_model = build("llama")
    with patched(patched_model, PatchConfig(policy="always")), pytest.raises(ValueError, match="revert the patch"):
        quantize(patched_model)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_cpu_paths_prefill_dense_and_bf16_decode_match_the_reference(kind):
    from plait.inference_kernels.quantization.modules import CPU_DENSE_ROWS
    from plait.kernels.ops.quant_matmul import quant_matmul_reference

    linear = torch.nn.Linear(128, 64, bias=True)
    config = QuantizeConfig(kind=kind, group_size=64 if kind == "int4" else None)
    fast = QuantizedLinear(linear, config.scheme, bf16_decode=True)
    for rows in (3, CPU_DENSE_ROWS):  # decode through torch's bf16 kernel, prefill through the fp32 GEMM
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows))
        want = quant_matmul_reference(x, fast.weight_codes, fast.weight_scales, fast.weight_zeros, config.scheme,
                                      linear.bias.detach())
        got = fast(x)
        assert got.dtype == torch.float32
        # decode rounds x to bf16 for torch's kernel: the bf16 entry; prefill is an fp32 GEMM
        key = torch.bfloat16 if rows < CPU_DENSE_ROWS else torch.float32
        tolerance("quant_matmul_cpu", key).assert_close(got, want, what=f"{kind} rows={rows}")


def test_benchmark_bytes_rows_and_alternating_order():
    from plait.inference_kernels.quantization import benchmark

    fp32 = build("llama")
    models = {"fp32 HF": fp32}
    configs = {"int8": benchmark.INT8_TORCH, "int4 g64": benchmark.INT4_TORCH}
    for label, config in configs.items():
        models[label] = copy.deepcopy(fp32)
        quantize(models[label], config)
    rows = benchmark.bytes_rows(models, configs)
    assert [r.passed for r in rows] == [True, True] and all(r.ours == r.peer_value for r in rows)
    order = []
    stats = benchmark._alternating({k: (lambda k=k: order.append(k)) for k in "ABC"}, warmup=0, rounds=2)
    assert order == list("ABCCBA") and set(stats) == set("ABC")


def test_benchmark_torchao_rows_run_or_say_why():
    """With torchao importable its int8 copy runs (logits near plait's int8); without it the row says so."""
    import importlib.util

    from plait.inference_kernels.quantization import benchmark

    if importlib.util.find_spec("torchao") is None:  # the usual CI case: the row says why, no model is built
        model, note = benchmark.torchao_quantized(torch.nn.Module(), "int8", head=False)
        assert model is None and note.startswith("torchao not installed")
        return
    base = build("llama")
    model, note = benchmark.torchao_quantized(base, "int8", head=False)
    assert model is not None and "Int8WeightOnlyConfig" in note
    ours = copy.deepcopy(base)
    quantize(ours, QuantizeConfig(kind="int8", cpu_kernels=False))
    ids = torch.randint(0, base.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = model(input_ids=ids).logits, ours(input_ids=ids).logits
    assert (a - b).abs().max() < 0.05 * b.abs().max()  # both round-to-nearest int8 per channel
    assert type(model.lm_head.weight) is torch.nn.Parameter  # head=False keeps the head as plait's row does


def test_quantized_linear_from_codes_equals_the_quantized_linear():
    from plait.inference_kernels.quantization import QuantizedLinear
    from plait.kernels.ops.quant_matmul import QuantScheme

    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 48)
    scheme = QuantScheme(kind="int4", group_size=32, symmetric=False)
    made = QuantizedLinear(linear, scheme)
    again = QuantizedLinear.from_codes(made.weight_codes, made.weight_scales, made.weight_zeros, scheme,
                                       in_features=128, dtype=torch.float32, bias=linear.bias)
    x = torch.randn(3, 128)
    assert torch.equal(again(x), made(x)) and again.weight_shape == (48, 128)
    with pytest.raises(ValueError, match="scales"):
        QuantizedLinear.from_codes(made.weight_codes, made.weight_scales[:, :2], made.weight_zeros, scheme,
                                   in_features=128, dtype=torch.float32)


def _experts_inputs(tokens: int, experts: int, k: int = 2, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, 128, generator=g)
    index = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    return x, index, torch.rand(tokens, k, generator=g)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_experts_match_transformers_experts_on_the_dequantized_weights(kind):
    # mixtral (intermediate 256): 3 tokens route few rows per expert (torch's bf16 kernels, with
    # bf16_decode), 80 tokens route >= 32 to most (the blocked dense path).
    experts = build("mixtral").model.layers[0].mlp.experts
    scheme = QuantizeConfig(kind=kind, group_size=64 if kind == "int4" else None).scheme
    fast = QuantizedExperts(experts, scheme, bf16_decode=True)
    oracle = QuantizedExperts(experts, scheme, cpu_kernels=False)  # the op's torch reference
    twin = fast.to_experts()
    assert type(twin) is type(experts) and twin.gate_up_proj.shape == experts.gate_up_proj.shape
    for tokens in (3, 80):
        x, index, weights = _experts_inputs(tokens, experts.num_experts)
        with torch.no_grad():
            want, ref, got = twin(x, index, weights), oracle(x, index, weights), fast(x, index, weights)
        tolerance("quant_matmul_cpu", torch.float32).assert_close(ref, want, what=f"{kind} reference")
        # few rows: activations rounded to bf16 for torch's kernels (the bf16 entry, two layers deep)
        key = torch.bfloat16 if tokens < 32 else torch.float32
        tol = tolerance("quant_matmul_cpu", key)
        torch.testing.assert_close(got, want, atol=4 * tol.atol, rtol=4 * tol.rtol)


def test_experts_option_bytes_revert_and_refusals():
    model = build("qwen3_moe")
    moe = "model.layers.0.mlp.experts"
    report = quantize(model, QuantizeConfig(kind="int8", experts=False))
    assert moe not in report.quantized and (moe, "fused MoE experts (QuantizeConfig.experts=False)") in report.kept
    revert(model)
    config = QuantizeConfig(kind="int4", group_size=64, symmetric=False, keep_original=False)
    shapes = [tuple(p.shape[1:]) for p in (model.get_submodule(moe).gate_up_proj, model.get_submodule(moe).down_proj)]
    report = quantize(model, config)
    experts = model.get_submodule(moe)
    assert experts.weight_shapes == (shapes[0],) * 4 + (shapes[1],) * 4
    sd = model.state_dict()
    assert f"{moe}.gate_up_proj" not in sd and f"{moe}.down.3.weight_zeros" in sd
    stored = sum(t.numel() * t.element_size() for key, t in sd.items() if key.startswith(moe))
    assert stored == sum(weight_nbytes(s, config.scheme) for s in experts.weight_shapes)
    gate_up, down = experts.dequantized_weights()
    revert(model)  # no originals kept: transformers' experts holding the dequantized weights
    assert type(model.get_submodule(moe)).__name__ == "Qwen3MoeExperts"
    assert torch.equal(model.get_submodule(moe).gate_up_proj, gate_up)
    assert torch.equal(model.get_submodule(moe).down_proj, down)
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.experts.down_proj: in_features=96 is not divisible"):
        quantize(bad := build("qwen3_moe", moe_intermediate_size=96), QuantizeConfig(kind="int4", group_size=64))
    assert not is_quantized(bad)
    skipped = build("qwen3_moe")
    report = quantize(skipped, QuantizeConfig(kind="int8", skip=("*.experts",)))
    assert (moe, "skipped by pattern '*.experts'") in report.kept
    assert type(skipped.get_submodule(moe)).__name__ == "Qwen3MoeExperts"


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_plait_cpu_kernel_decode_and_prefill_match_the_reference_model(kind):
    """``cpu_kernel="plait"``: a quantized Llama's logits (decode-sized and prefill-sized inputs)
    against the same quantized weights on the torch reference (fp32 activations both)."""
    from plait.kernels.ops import quant_matmul_cpu

    if not quant_matmul_cpu.cpu_supported():
        pytest.skip("no AVX2 on this CPU: cpu_kernel='plait' is refused here (tested below)")
    base = build("llama")
    group = 32 if kind == "int4" else None
    fast, oracle = copy.deepcopy(base), copy.deepcopy(base)
    quantize(fast, QuantizeConfig(kind=kind, group_size=group, head=True, cpu_kernel="plait"))
    quantize(oracle, QuantizeConfig(kind=kind, group_size=group, head=True, cpu_kernels=False))
    assert all(m._own for m in fast.modules() if isinstance(m, QuantizedLinear) and m.in_features % 16 == 0)
    for tokens in (3, 40):  # under and over CPU_DENSE_ROWS: the register GEMV, then the blocked GEMM
        ids = torch.randint(0, 128, (2, tokens), generator=torch.Generator().manual_seed(tokens))
        with torch.no_grad():
            torch.testing.assert_close(fast(input_ids=ids).logits, oracle(input_ids=ids).logits, atol=1e-4, rtol=1e-4)


def test_plait_cpu_kernel_refused_where_it_cannot_run(monkeypatch):
    from plait.kernels.ops import quant_matmul_cpu

    with pytest.raises(ValueError, match=r"QuantizeConfig.cpu_kernel='avx' is not supported; use one of torch, plait"):
        QuantizeConfig(kind="int8", cpu_kernel="avx")
    monkeypatch.setattr(quant_matmul_cpu, "available", lambda: False)
    monkeypatch.setattr(quant_matmul_cpu, "build_error", "no C++ compiler ('c++' not found; set CXX)")
    with pytest.raises(ValueError, match=r"QuantizeConfig.cpu_kernel='plait' cannot be used here: no C\+\+ "
                                         r"compiler .*use cpu_kernel='torch'"):
        QuantizeConfig(kind="int8", cpu_kernel="plait")
