"""``ExpertParallelExtension`` (the ``ep_size`` extension of the Lightning and HF Trainer integrations) on
gloo, ep=2: it shards every MoE layer's experts, splits the optimizer's groups into dense and expert
groups with the experts' global identities, converts HF sparse-MoE blocks keeping their names, and
refuses what it cannot do with the host's setting named."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait.kernels.mesh import make_mesh
from plait.kernels.testing import run_distributed
from plait.moe_layers import MoE, MoEConfig, expert_parameters
from plait.moe_layers.zero_extension import ExpertParallelExtension

H, I, E = 8, 6, 4


class _Net(nn.Module):
    def __init__(self, experts: int = E) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(H, H)
        self.moe = MoE(MoEConfig(hidden_size=H, num_experts=experts, intermediate_size=I, top_k=2))


def _plait_layers() -> dict:
    mesh = make_mesh(dp=-1, ep=2)
    ext = ExpertParallelExtension(mesh, setting="PlaitConfig.ep_size")
    net = _Net()
    full = {n: p.detach().clone() for n, p in net.named_parameters()}
    user_groups = [{"params": list(net.parameters()), "lr": 0.1}]  # built before apply, as a user would
    assert ext.apply(net, mesh) is net
    groups = ext.regroup(user_groups)
    experts = {id(p) for p in expert_parameters(net)}
    current = {id(p) for p in net.parameters()}
    dense, expert = groups
    identity = expert["zero_global"]
    rows = {n: identity(n, tuple(p.shape)) for n, p in net.named_parameters() if id(p) in experts}
    dist.barrier()  # no rank leaves while another still builds its groups
    return {
        "order": (ext.order, repr(ext), ext.zero_kwargs()),
        "local_experts": net.moe.experts.local_experts,
        "dense_ok": all(id(p) in current and id(p) not in experts for p in dense["params"]),
        "expert_ok": all(id(p) in experts for p in expert["params"]) and len(expert["params"]) == len(experts),
        "lr": (dense["lr"], expert["lr"]),
        "edp": expert["zero_group"] is ext.groups.edp_group,
        "dense_named": "zero_global" in dense,
        "rows": rows,
        "full_shapes": {n: tuple(t.shape) for n, t in full.items()},
        "slices_equal": all(torch.equal(p.detach(), full[n].narrow(0, rows[n][2], p.shape[0]))
                            for n, p in net.named_parameters() if id(p) in experts),
        "rank": dist.get_rank(),
    }


def test_experts_are_sharded_and_the_groups_split_with_global_identities():
    for got in run_distributed(_plait_layers, 2, timeout=120):
        assert got["order"] == (20, "ExpertParallel(ep=2)", {})
        assert got["local_experts"] == E // 2
        assert got["dense_ok"] and got["expert_ok"] and got["edp"]
        assert got["lr"] == (0.1, 0.1)
        assert not got["dense_named"]  # nothing converted: dense parameters keep their own names
        for name, (global_name, shape, row) in got["rows"].items():
            assert global_name == name and shape == got["full_shapes"][name]
            assert row == got["rank"] * (E // 2)
        assert got["slices_equal"]  # each rank holds its rows of the full (identically built) experts


def _refusals() -> list[str]:
    mesh = make_mesh(dp=-1, ep=2)
    messages = []
    for module in (nn.Linear(H, H), _Net(experts=3)):
        with pytest.raises(ValueError) as info:
            ExpertParallelExtension(mesh, setting="ep_size").apply(module, mesh)
        messages.append(str(info.value))
    with pytest.raises(RuntimeError, match="after apply"):
        ExpertParallelExtension(mesh).regroup([])
    dist.barrier()
    return messages


def test_refusals_name_the_hosts_setting():
    no_moe, uneven = run_distributed(_refusals, 2, timeout=120)[0]
    assert no_moe.startswith("ep_size=2: Linear has no plait MoE layer and no HF")
    assert uneven.startswith("ep_size=2: ") and "num_experts=3 is not divisible by ep_size=2" in uneven


def _hf_mixtral() -> dict:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MixtralConfig(hidden_size=16, intermediate_size=8, num_hidden_layers=1,
                                        num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                                        num_experts_per_tok=2, vocab_size=32, max_position_embeddings=32)
    model = transformers.AutoModelForCausalLM.from_config(config)
    hf_names = {n for n, _ in model.named_parameters()}
    mesh = make_mesh(dp=-1, ep=2)
    ext = ExpertParallelExtension(mesh)
    ext.apply(model, mesh)
    dense, expert = ext.regroup([{"params": list(model.parameters())}])
    named = {n: p for n, p in model.named_parameters()}
    dense_names = {dense["zero_global"](n, tuple(p.shape))[0] for n, p in named.items()
                   if any(p is q for q in dense["params"])}
    expert_names = {expert["zero_global"](n, tuple(p.shape))[0] for n, p in named.items()
                    if any(p is q for q in expert["params"])}
    dist.barrier()
    return {"converted": bool(ext.hf_names), "hf": hf_names, "names": dense_names | expert_names}


def test_hf_mixtral_blocks_are_converted_and_keep_their_hf_names():
    got = run_distributed(_hf_mixtral, 2, timeout=180)[0]
    assert got["converted"]
    assert got["names"] == got["hf"]  # checkpoints and exports name every parameter as the HF model does
