"""plait-transformers with plait-moe-layers: ``ep_size=2`` through the HF Trainer's plait config
(JSON ``{"ep_size": 2}`` or ``PlaitConfig(ep_size=2)``) at W=2 (gloo) on tiny random HF Mixtral and
Qwen2-MoE models follows the plain DDP Trainer on the unchanged HF model, same data and seed.

Under ``ep_size=2`` the Trainer's model has its HF sparse-MoE blocks converted to plait MoE layers
(same parameters, same logits), each rank keeps 2 of the 4 experts of every layer and exchanges
tokens with the other (all-to-all); ZeRO shards the dense parameters over both ranks and each
rank's experts over its expert-data-parallel group. Checked: losses and pre-clip gradient norms
(ZeRO-3 with gradient accumulation and clipping; ZeRO-2 on Qwen2-MoE with its shared expert), the
expert split and the token all-to-alls; ``save_model()`` under ep writes what ``from_pretrained``
loads (every expert, HF's parameter names) with the DDP-trained model's logits; bad settings fail
when the Trainer is built.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from plait.kernels.testing import run_distributed

pytest.importorskip("plait.moe_layers")
pytest.importorskip("plait.transformers")

STEPS, GA, CLIP, SAVE_AT = 3, 2, 0.3, 2
# fp32, same data and seed; experts run on rows gathered from the ep group and the router's
# gradient is summed over ranks, so the last bits may differ from DDP's. Measured here: losses equal
# bitwise (Mixtral and Qwen2-MoE); as the other Trainer tests vs DDP: 1e-5.
RTOL = 1e-5
MOE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=16, vocab_size=256, max_position_embeddings=64, num_experts_per_tok=2, tie_word_embeddings=False)


def moe_model(kind: str) -> Any:
    """A tiny random HF MoE causal LM (seed 0): ``"mixtral"`` or ``"qwen2_moe"`` (with a shared expert)."""
    import transformers

    torch.manual_seed(0)
    if kind == "mixtral":
        config = transformers.MixtralConfig(**MOE, num_local_experts=4)
    else:
        config = transformers.Qwen2MoeConfig(**MOE, num_experts=4, moe_intermediate_size=48,
                                             shared_expert_intermediate_size=64, decoder_sparse_step=1)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config)


def _train(tmp: str, name: str, kind: str, plait: Any, resume: str | None = None, **args: Any) -> dict[str, Any]:
    import transformers

    from plait.kernels.collectives import ByteLedger
    from plait.transformers import with_plait
    from plait.transformers.demo import TokenDataset, quiet, training_args

    quiet()
    transformers.logging.set_verbosity_error()
    cls = transformers.Trainer if plait is None else with_plait(transformers.Trainer, plait)
    trainer = cls(model=moe_model(kind), train_dataset=TokenDataset(seq_len=16),
                  args=training_args(f"{tmp}/{name}", max_steps=STEPS, per_device_train_batch_size=2,
                                     gradient_accumulation_steps=GA, **args))
    with ByteLedger() as ledger:
        trainer.train(resume_from_checkpoint=resume)
    history = trainer.state.log_history
    from plait.moe_layers import moe_layers
    from plait.transformers.demo import probe_ids

    if plait is None:  # the trained HF model's logits
        with torch.no_grad():
            logits = trainer.model.eval()(input_ids=probe_ids()).logits
    else:  # what save_model() exported, as from_pretrained reads it
        trainer.save_model(f"{tmp}/{name}/export")
        loaded = transformers.AutoModelForCausalLM.from_pretrained(f"{tmp}/{name}/export")
        with torch.no_grad():
            logits = loaded.eval()(input_ids=probe_ids()).logits

    return {"losses": [float(h["loss"]) for h in history if "loss" in h],
            "grad_norms": [float(h["grad_norm"]) for h in history if h.get("grad_norm") is not None],
            "experts": [(layer.ep_size, layer.experts.first_expert, layer.experts.local_experts)
                        for layer in moe_layers(trainer.model)],
            "all_to_all": ledger.total(op="all_to_all"), "logits": logits}


def _session(tmp: str) -> dict[str, Any]:
    from plait.transformers import PlaitConfig
    from plait.zero_sharding import ZeroConfig

    torch.set_num_threads(1)
    return {"ddp_mixtral": _train(tmp, "ddp_mixtral", "mixtral", None, max_grad_norm=CLIP),
            "ep_mixtral": _train(tmp, "ep_mixtral", "mixtral", {"zero": {"stage": 3}, "ep_size": 2},
                                 max_grad_norm=CLIP, save_strategy="steps", save_steps=SAVE_AT),
            "ep_resumed": _train(tmp, "ep_resumed", "mixtral", {"zero": {"stage": 3}, "ep_size": 2},
                                 max_grad_norm=CLIP, resume=f"{tmp}/ep_mixtral/checkpoint-{SAVE_AT}"),
            "ddp_qwen": _train(tmp, "ddp_qwen", "qwen2_moe", None, max_grad_norm=CLIP),
            "ep_qwen": _train(tmp, "ep_qwen", "qwen2_moe", PlaitConfig(zero=ZeroConfig(stage=2), ep_size=2),
                              max_grad_norm=CLIP)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_distributed(_session, 2, str(tmp_path_factory.mktemp("hf_ep")), timeout=400)


def _close(actual: list[float], expected: list[float]) -> float:
    assert len(actual) == len(expected) > 0, (actual, expected)
    for a, e in zip(actual, expected):
        assert math.isclose(a, e, rel_tol=RTOL), (actual, expected)
    return max(abs(a / e - 1) for a, e in zip(actual, expected))


@pytest.mark.timeout(480)
@pytest.mark.parametrize("kind", ["mixtral", "qwen"])
def test_ep2_follows_the_ddp_trainer(runs: list[dict[str, Any]], kind: str) -> None:
    for rank, result in enumerate(runs):
        ddp, ep = result[f"ddp_{kind}"], result[f"ep_{kind}"]
        assert ddp["experts"] == [] and ddp["all_to_all"] == 0  # the reference keeps HF's own blocks
        assert ep["experts"] == [(2, 2 * rank, 2)] * 2, ep["experts"]  # 2 of 4 experts in both layers
        assert ep["all_to_all"] > 0  # tokens travelled to the other rank's experts
        worst = _close(ep["losses"], ddp["losses"])
        _close(ep["grad_norms"], ddp["grad_norms"])
        assert min(ddp["grad_norms"]) > CLIP  # clipping acted at every step
        print(kind, rank, "ddp", ddp["losses"], "ep", ep["losses"], "max rel", worst)


@pytest.mark.timeout(480)
@pytest.mark.parametrize("kind", ["mixtral", "qwen"])
def test_save_model_under_ep_loads_with_from_pretrained(runs: list[dict[str, Any]], kind: str) -> None:
    """Every expert, and the router under HF's name (``gate``): the export is the trained HF model."""
    for result in runs:
        torch.testing.assert_close(result[f"ep_{kind}"]["logits"], result[f"ddp_{kind}"]["logits"],
                                   rtol=RTOL, atol=1e-6)


@pytest.mark.timeout(480)
def test_ep2_resumes_from_its_checkpoint_on_the_same_curve(runs: list[dict[str, Any]]) -> None:
    for result in runs:
        assert result["ep_resumed"]["losses"] == result["ep_mixtral"]["losses"]
        torch.testing.assert_close(result["ep_resumed"]["logits"], result["ep_mixtral"]["logits"], rtol=0, atol=0)


def _sp_ep_session(tmp: str) -> dict[str, Any]:
    """W=4: the plain DDP Trainer, then sp 2 x ep 2 (dp 1) on the same Mixtral and data."""
    torch.set_num_threads(1)
    return {"ddp": _train(tmp, "ddp4", "mixtral", None, max_grad_norm=CLIP),
            "sp_ep": _train(tmp, "sp_ep", "mixtral", {"zero": {"stage": 3}, "sp_size": 2, "ep_size": 2},
                            max_grad_norm=CLIP)}


@pytest.mark.timeout(480)
def test_sp2_with_ep2_follows_the_ddp_trainer(tmp_path: Path) -> None:
    """Sequence and expert parallelism composed (sp at order 10, MoE at 20, ZeRO last) on 4 ranks."""
    pytest.importorskip("plait.ulysses_sp")
    results = run_distributed(_sp_ep_session, 4, str(tmp_path), timeout=420)
    for rank, result in enumerate(results):
        ddp, ours = result["ddp"], result["sp_ep"]
        assert ours["experts"] == [(2, 2 * ((rank // 2) % 2), 2)] * 2, ours["experts"]  # ep pairs (0,2), (1,3)
        worst = _close(ours["losses"], ddp["losses"])
        _close(ours["grad_norms"], ddp["grad_norms"])
        torch.testing.assert_close(ours["logits"], ddp["logits"], rtol=RTOL, atol=1e-6)
        print("sp x ep", rank, "ddp", ddp["losses"], "ours", ours["losses"], "max rel", worst)


@pytest.mark.parametrize(("config", "named"), [
    ({"ep_size": -1}, r"PlaitConfig\.ep_size=-1"),
    ({"ep_size": 2}, r"PlaitConfig\.ep_size=2 does not divide the world size 1"),
])
def test_bad_ep_settings_fail_when_the_trainer_is_built(tmp_path: Path, config: dict, named: str) -> None:
    import transformers

    from plait.transformers import with_plait
    from plait.transformers.demo import TokenDataset, training_args

    with pytest.raises(ValueError, match=named):
        with_plait(transformers.Trainer, config)(model=moe_model("mixtral"), train_dataset=TokenDataset(8),
                                                 args=training_args(str(tmp_path)))
