"""HF model patching: greedy-generation parity (fp32) and logit tolerance (bf16) for every family,
idempotent apply, exact revert, refusal of unknown families and transformers versions, training
gradients, and isolation of unpatched models. Tiny models are built offline from configs."""

from __future__ import annotations

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from plait.inference_kernels.patching import (  # noqa: E402
    PatchConfig,
    UnsupportedModelError,
    UnsupportedTransformersError,
    apply,
    check_transformers_version,
    forwards,
    is_patched,
    patch_report,
    patched,
    registry,
    revert,
    supported_families,
)
from plait.kernels.tolerances import tolerance  # noqa: E402

COMMON = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64, intermediate_size=256,
              num_hidden_layers=2, vocab_size=256)
MOE = dict(num_experts_per_tok=2)


def _config(family: str):
    if family == "llama":
        return transformers.LlamaConfig(**COMMON)
    if family == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=8)
    if family == "qwen2":
        return transformers.Qwen2Config(**COMMON)
    if family == "qwen3":
        return transformers.Qwen3Config(**COMMON)
    if family == "mixtral":
        return transformers.MixtralConfig(**COMMON, **MOE, num_local_experts=4)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**COMMON, **MOE, num_experts=4, moe_intermediate_size=64,
                                           shared_expert_intermediate_size=128)
    if family == "qwen3_moe":  # layer 1 dense (mlp_only_layers) so both MLP kinds are exercised
        return transformers.Qwen3MoeConfig(**COMMON, **MOE, num_experts=4, moe_intermediate_size=64,
                                           mlp_only_layers=[1])
    raise AssertionError(family)


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
# The plait ops a forward of every patched family must reach. On the CPU reference backend the
# patch calls the ops' references directly (the HF modules guarantee what the public ops validate),
# and in fp32 rotary takes the reference's in-place NeoX rotation (rotate_neox_in_place).
# plait patches on any device here: these tests exercise the patching and its reference path
ALWAYS = PatchConfig(policy="always")
EXPECTED_CALLS = ("rms_norm_reference", "gated_activation_reference", "rotate_neox_in_place")


def build(family: str, dtype=torch.float32, seed: int = 0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(_config(family)).eval().to(dtype)
    return model


def _prompt(seed: int = 1):
    return torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                              pad_token_id=0)


@pytest.fixture
def op_calls(monkeypatch):
    """Count calls of the plait ops the patched forwards use."""
    calls: dict[str, int] = {}
    for name in ("rms_norm_reference", "gated_activation_reference", "apply_rotary", "rotary_embedding",
                 "rotate_neox_in_place"):
        original = getattr(forwards, name)

        def spy(*args, _original=original, _name=name, **kwargs):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(forwards, name, spy)
    return calls


def test_supported_families_cover_the_issue():
    assert set(FAMILIES) <= set(supported_families())


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_identical_fp32(family, op_calls):
    model = build(family)
    ids = _prompt()
    with torch.no_grad():
        logits_before = model(ids).logits
    tokens_before = _generate(model, ids)
    report = apply(model, ALWAYS)
    op_calls.clear()
    tokens_after = _generate(model, ids)
    assert torch.equal(tokens_after, tokens_before)
    assert all(op_calls.get(op, 0) > 0 for op in EXPECTED_CALLS), (op_calls, report)
    with torch.no_grad():
        logits_after = model(ids).logits
    tolerance("hf_patched_logits", torch.float32).assert_close(logits_after, logits_before, what=family)
    assert report.family == family and report.skipped == ()
    assert report.patched["rms_norm"] >= 2 * COMMON["num_hidden_layers"] + 1
    assert report.patched["attention_rotary"] == COMMON["num_hidden_layers"]
    revert(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_logits_within_tolerance(family, op_calls):
    model = build(family)
    reference = copy.deepcopy(model)  # fp32 oracle
    model = model.to(torch.bfloat16)
    ids = _prompt(2)
    with torch.no_grad():
        exact = reference(ids).logits
        hf_bf16 = model(ids).logits.float()
        with patched(model, ALWAYS):
            plait_bf16 = model(ids).logits.float()
    # bf16 inference takes the public in-place op (fp32 compute, one rounding per element).
    assert op_calls.get("apply_rotary", 0) > 0 and op_calls.get("rms_norm_reference", 0) > 0, op_calls
    tolerance("hf_patched_logits", torch.bfloat16).assert_close(plait_bf16, hf_bf16, what=family)
    # plait rounds once per op where HF rounds after every element-wise step, so it must not be
    # further from the fp32 model than HF's own bf16 forward is (25% slack for noise).
    assert (plait_bf16 - exact).abs().mean() <= 1.25 * (hf_bf16 - exact).abs().mean()


@pytest.mark.parametrize("family", ("llama", "qwen3_moe"))
def test_apply_is_idempotent_and_revert_is_exact(family):
    model = build(family)
    ids = _prompt()
    hf_module = __import__(f"transformers.models.{family}.modeling_{family}", fromlist=["x"])
    original_rotary = hf_module.apply_rotary_pos_emb
    snapshot = {name: dict(m.__dict__) for name, m in model.named_modules()}
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        before = model(ids).logits

    first = apply(model, ALWAYS)
    bound = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    assert apply(model, ALWAYS) is first  # second apply: no-op returning the same report
    assert {name: m.__dict__.get("forward") for name, m in model.named_modules()} == bound
    assert is_patched(model) and patch_report(model) is first
    assert forwards.rotary_hook_installed(hf_module)

    assert revert(model) is True and revert(model) is False
    assert not is_patched(model) and hf_module.apply_rotary_pos_emb is original_rotary
    for name, module in model.named_modules():
        assert module.__dict__.keys() == snapshot[name].keys(), name
        for key, value in snapshot[name].items():
            assert module.__dict__[key] is value, (name, key)
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_patched_context_manager_and_config_conflict():
    model = build("qwen2")
    with patched(model, PatchConfig(mlp=False, policy="always")) as report:
        assert report.patched["mlp"] == 0 and report.patched["rms_norm"] > 0
        with pytest.raises(ValueError, match="revert"):
            apply(model, ALWAYS)  # default config differs from the one applied
        with patched(model, PatchConfig(mlp=False, policy="always")):  # nested, same config: leaves it patched
            pass
        assert is_patched(model)
    assert not is_patched(model)
    with pytest.raises(ValueError, match="PatchConfig.rotary"):
        PatchConfig(rotary="yes")


def test_unknown_family_is_refused_before_any_change():
    config = transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(UnsupportedModelError, match=r"'gpt2'.*llama.*qwen3_moe"):
        apply(model, ALWAYS)
    assert not is_patched(model)
    with pytest.raises(UnsupportedModelError, match="model_type"):
        apply(torch.nn.Linear(2, 2))


def test_transformers_version_range(monkeypatch):
    assert check_transformers_version("5.19.0") == "5.19.0"
    assert check_transformers_version("5.0.0.dev0") == "5.0.0.dev0"
    for bad in ("4.46.3", "6.0.0", "garbage"):
        with pytest.raises(UnsupportedTransformersError):
            check_transformers_version(bad)
    model = build("llama")
    monkeypatch.setattr(registry, "installed_transformers_version", lambda: "4.57.0")
    with pytest.raises(UnsupportedTransformersError, match=r"transformers>=5.0,<6.0.*4.57.0"):
        apply(model, ALWAYS)
    assert not is_patched(model) and not any(forwards.is_installed(m) for m in model.modules())


@pytest.mark.parametrize("family", ("llama", "qwen2_moe"))
def test_training_gradients_match(family, op_calls):
    model = build(family)
    model.train()
    reference = copy.deepcopy(model)
    ids = _prompt(3)
    apply(model, ALWAYS)
    loss = model(ids, labels=ids).loss
    loss.backward()
    ref_loss = reference(ids, labels=ids).loss
    ref_loss.backward()
    assert op_calls.get("rotary_embedding", 0) > 0
    assert "apply_rotary" not in op_calls and "rotate_neox_in_place" not in op_calls
    torch.testing.assert_close(loss, ref_loss, atol=1e-5, rtol=1e-5)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_params[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_unpatched_model_of_same_family_is_untouched(op_calls):
    patched_model, plain_model = build("llama"), build("llama", seed=5)
    apply(patched_model, ALWAYS)
    op_calls.clear()
    with torch.no_grad():
        plain_model(_prompt())
    assert op_calls == {}
    revert(patched_model)


def test_fused_weight_cache_follows_in_place_updates():
    model = build("llama")
    ids = _prompt()
    apply(model, ALWAYS)
    with torch.no_grad():
        model(ids)
        for module in model.modules():
            if type(module).__name__ == "LlamaMLP":
                module.up_proj.weight.mul_(0.5)
        after_update = model(ids).logits
    revert(model)
    with torch.no_grad():
        torch.testing.assert_close(after_update, model(ids).logits, atol=1e-5, rtol=1e-5)


def test_eager_experts_are_reported_as_skipped():
    model = build("mixtral")
    model.set_experts_implementation("eager")
    report = apply(model, ALWAYS)
    assert report.patched["experts_gate"] == 0
    assert any("experts_implementation='eager'" in reason for reason in report.skipped)
    revert(model)


def test_mixed_dtype_norm_falls_back_to_hf():
    model = build("llama")
    norm = model.model.norm
    apply(model, ALWAYS)
    x = torch.randn(2, 3, 128, dtype=torch.bfloat16)
    out = norm(x)  # fp32 weight, bf16 input: HF promotes to fp32; the patch must keep that
    revert(model)
    assert out.dtype == torch.float32 and torch.equal(out, norm(x))


def test_rotary_hook_is_shared_and_removed_with_the_last_patched_model():
    hf_module = __import__("transformers.models.llama.modeling_llama", fromlist=["x"])
    original = hf_module.apply_rotary_pos_emb
    first, second = build("llama"), build("llama", seed=3)
    apply(first, ALWAYS)
    apply(second, ALWAYS)
    revert(first)
    assert forwards.rotary_hook_installed(hf_module)  # second still needs it
    revert(second)
    assert hf_module.apply_rotary_pos_emb is original


def test_deepcopy_of_a_patched_model_is_patched_and_independent(op_calls):
    hf_module = __import__("transformers.models.llama.modeling_llama", fromlist=["x"])
    model = build("llama")
    ids = _prompt()
    apply(model, ALWAYS)
    clone = copy.deepcopy(model)
    assert is_patched(clone)
    assert clone.model.norm.forward.__self__ is clone.model.norm  # rebound to the copy
    revert(model)
    assert forwards.rotary_hook_installed(hf_module)  # the clone still uses it
    op_calls.clear()
    with torch.no_grad():
        tolerance("hf_patched_logits", torch.float32).assert_close(clone(ids).logits, model(ids).logits)
    assert op_calls.get("rotate_neox_in_place", 0) > 0
    revert(clone)
    assert not forwards.rotary_hook_installed(hf_module)


@pytest.mark.parametrize("act", ["gelu", "gelu_pytorch_tanh", "relu"])
def test_mlp_activation_mapping(act, op_calls):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**COMMON, "num_hidden_layers": 1}, hidden_act=act)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ids = _prompt()
    with torch.no_grad():
        before = model(ids).logits
        report = apply(model, ALWAYS)
        op_calls.clear()
        after = model(ids).logits
    revert(model)
    if act == "relu":  # no gated plait op for it: MLP left alone and said so
        assert report.patched["mlp"] == 0 and any("hidden_act='relu'" in r for r in report.skipped)
        assert "gated_activation_reference" not in op_calls
    else:
        assert report.patched["mlp"] == 1 and op_calls.get("gated_activation_reference", 0) > 0
    tolerance("hf_patched_logits", torch.float32).assert_close(after, before, what=act)


def test_rotary_with_an_unexpected_cos_layout_is_left_unpatched():
    model = build("llama")
    rotary = model.model.rotary_emb
    original = rotary.forward

    def shifted(x, position_ids):  # cos/sin whose halves differ: not the layout the hook reads
        cos, sin = original(x, position_ids)
        half = cos.shape[-1] // 2
        return torch.cat((cos[..., :half], 0.5 * cos[..., half:]), -1), sin

    rotary.forward = shifted
    report = apply(model, ALWAYS)
    assert report.patched["attention_rotary"] == 0
    assert any("cat(freqs, freqs)" in reason for reason in report.skipped)
    revert(model)


def test_forced_triton_without_interpreter_fails_clearly_on_cpu(monkeypatch):
    model = build("llama")
    apply(model, ALWAYS)
    monkeypatch.setenv("PLAIT_KERNEL_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with torch.no_grad(), pytest.raises(ValueError, match="TRITON_INTERPRET"):
        model(_prompt())
    revert(model)


def test_rotary_with_an_unknown_function_signature_is_left_unpatched(monkeypatch):
    hf_module = __import__("transformers.models.llama.modeling_llama", fromlist=["x"])

    def old_style(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):  # the transformers 4.3x signature
        return q, k

    monkeypatch.setattr(hf_module, "apply_rotary_pos_emb", old_style)
    model = build("llama")
    report = apply(model, ALWAYS)
    assert report.patched["attention_rotary"] == 0 and report.patched["rms_norm"] > 0
    assert any("position_ids" in reason for reason in report.skipped)
    revert(model)
    assert hf_module.apply_rotary_pos_emb is old_style


def test_float64_model_keeps_working_through_fallbacks():
    model = build("qwen3", dtype=torch.float64)
    ids = _prompt()
    with torch.no_grad():
        before = model(ids).logits
        with patched(model, ALWAYS):
            after = model(ids).logits
    assert after.dtype == torch.float64
    torch.testing.assert_close(after, before, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("family", ("llama", "qwen3_moe"))
def test_default_policy_keeps_the_models_own_code_where_plait_runs_its_reference(family, op_calls, monkeypatch):
    monkeypatch.setenv("PLAIT_KERNEL_BACKEND", "auto")  # CPU tensors: plait's ops would run their reference
    model = build(family)
    ids = _prompt()
    tokens_before = _generate(model, ids)
    with patched(model) as report:
        assert report.config.policy == "auto" and sum(report.patched.values()) == 0
        assert report.kept and all("kept the model's own code" in line and "on cpu" in line for line in report.kept)
        assert any(line.startswith("rms_norm:") for line in report.kept)
        op_calls.clear()
        assert torch.equal(_generate(model, ids), tokens_before)
        assert not any(op_calls.get(op, 0) for op in EXPECTED_CALLS), op_calls  # the model's own code ran
    with pytest.raises(ValueError, match="PatchConfig.policy='sometimes'"):
        PatchConfig(policy="sometimes")
