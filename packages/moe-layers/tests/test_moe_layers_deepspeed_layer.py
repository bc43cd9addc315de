"""``plait.moe_layers.deepspeed.MoE`` against DeepSpeed's own ``deepspeed.moe.layer.MoE``: the same
constructor arguments and the same weights (DeepSpeed's state dict loaded under its own key names)
give the same output, ``l_aux``, ``exp_counts`` and gradients, with the capacity binding, from the
same torch seed (random token selection and second-expert sampling draw what DeepSpeed draws)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from plait.moe_layers import deepspeed as plait_ds

os.environ.setdefault("DS_ACCELERATOR", "cpu")
ds_layer = pytest.importorskip("deepspeed.moe.layer")

H, E = 8, 4


class BiasExpert(nn.Module):
    """An (output, bias) expert, the Megatron shape DeepSpeed accepts (it keeps the output)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(H, 16), nn.Linear(16, H)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc2(torch.nn.functional.gelu(self.fc1(x))), self.fc2.bias


def _expert(kind: str) -> nn.Module:
    if kind == "tuple":
        return BiasExpert()
    return nn.Sequential(nn.Linear(H, 16), nn.GELU(), nn.Linear(16, H))


def _skewed_tokens(seed: int) -> torch.Tensor:
    """Tokens most of which prefer the first experts, so the capacity binds."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 12, H, generator=gen)
    x[..., 0] += 1.5
    return x


CASES = {
    "top1_rts": dict(k=1),
    "top1_rsample": dict(k=1, noisy_gate_policy="RSample"),
    "top2_sampling": dict(k=2),
    "top2_plain_residual": dict(k=2, top2_2nd_expert_sampling=False, use_residual=True),
    "top3": dict(k=3, capacity_factor=0.6),
    "top2_dropless": dict(k=2, drop_tokens=False, top2_2nd_expert_sampling=False),
}


@pytest.mark.parametrize("expert_kind", ["sequential", "tuple"])
@pytest.mark.parametrize("case", list(CASES))
def test_whole_layer_equals_deepspeeds(case, expert_kind):
    kwargs = dict(num_experts=E, capacity_factor=0.5, min_capacity=1) | CASES[case]
    torch.manual_seed(0)
    theirs = ds_layer.MoE(H, _expert(expert_kind), **kwargs)
    ours = plait_ds.MoE(H, _expert(expert_kind), **kwargs)
    ours.load_state_dict(theirs.state_dict())  # DeepSpeed's key names
    for mode in ("train", "eval"):
        if mode == "eval" and case == "top2_sampling":
            continue  # DeepSpeed samples the second expert in eval mode too; plait's eval routing is deterministic
        theirs.train(mode == "train")
        ours.train(mode == "train")
        x_theirs = _skewed_tokens(1).requires_grad_()
        x_ours = _skewed_tokens(1).requires_grad_()
        torch.manual_seed(5)
        out_t, aux_t, counts_t = theirs(x_theirs)
        torch.manual_seed(5)
        out_o, aux_o, counts_o = ours(x_ours)
        torch.testing.assert_close(out_o, out_t, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(aux_o, aux_t, rtol=1e-6, atol=1e-7)
        assert torch.equal(counts_o, counts_t)
        (out_t.square().sum() + aux_t).backward()
        (out_o.square().sum() + aux_o).backward()
        torch.testing.assert_close(x_ours.grad, x_theirs.grad, rtol=1e-5, atol=1e-6)
    grads = {name: p.grad for name, p in theirs.named_parameters()}
    plait_ds._rename_deepspeed_keys(grads, "")  # DeepSpeed's names -> plait's
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)
    capacity = ours.config.capacity(24, training=True)
    if capacity is not None:  # the capacity binds (counts are before drops), or the test would mean less
        assert int(counts_t.max()) > capacity, (counts_t, capacity)


def test_the_mapping_and_refusals_name_the_argument():
    config = plait_ds.deepspeed_moe_config(H, E, k=2)
    assert (config.drop_policy, config.renormalize_after_drops, config.aux_loss_choices, config.noise,
            config.noise_eps) == ("position", True, "first", "gumbel_after_first", 1.0)
    assert plait_ds.deepspeed_moe_config(H, E, k=1, use_rts=False).drop_policy == "position"
    assert plait_ds.deepspeed_moe_config(H, E, k=2, drop_tokens=False).capacity_factor is None
    with pytest.raises(ValueError, match=r"num_experts=4, ep_size=3\): ep_size must divide num_experts"):
        plait_ds.MoE(H, _expert("sequential"), num_experts=E, ep_size=3)
    with pytest.raises(ValueError, match=r"ep_size=0\) must be a positive int"):
        plait_ds.MoE(H, _expert("sequential"), num_experts=E, ep_size=0)
    with pytest.raises(ValueError, match="use_tutel"):
        plait_ds.MoE(H, _expert("sequential"), num_experts=E, use_tutel=True)
    with pytest.raises(ValueError, match="noisy_gate_policy='Jitter' with k=2"):
        plait_ds.MoE(H, _expert("sequential"), num_experts=E, k=2, noisy_gate_policy="Jitter")
    with pytest.raises(ValueError, match="noisy_gate_policy='Gauss'"):
        plait_ds.MoE(H, _expert("sequential"), num_experts=E, noisy_gate_policy="Gauss")
    layer = plait_ds.MoE(H, _expert("sequential"), num_experts=E, k=1)
    with pytest.raises(ValueError, match="used_token"):
        layer(torch.randn(3, H), used_token=torch.ones(3))
