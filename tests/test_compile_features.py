"""ZeRO's other features under ``torch.compile`` (cross-package): ZeRO++ (qwZ + qgZ + hpZ), CPU
offload (plait-offload-io), Ulysses ``sp_size`` (plait-ulysses-sp) and MoE ``ep_size``
(plait-moe-layers), each at W=2 (gloo) on a tiny HF model compiled per block as torchtitan does
(``block.compile()`` on every decoder layer), against the same setup run eagerly.

For every feature, on every rank: the losses of ``STEPS`` training steps equal the eager ones
within the tolerance table's ``compiled_losses_vs_eager``. For ZeRO++, offload and Ulysses: no
graph break is reported at a line of a block's code (its modules' ``forward`` and, for Ulysses,
the files its all-to-alls run through), every break dynamo counts is a call into a ZeRO hook
(``torch.compiler.disable``, at the block's boundary), and no graph is compiled after the first
step.

MoE with ``ep_size`` is the known exception, checked as it is: token dispatch is data-dependent
(which tokens go where, and the row counts exchanged with the other ranks), so dynamo breaks the
MoE layer's graph there, and only there (``plait.moe_layers.dispatch``): at ``nonzero`` over the
kept assignments, at the count exchange (compiler-disabled) and at ``repeat_interleave`` by the
received counts. The row counts change every step, so the second step recompiles once with
dynamic shapes; from then on no graph is compiled.

All four run in one session (process start-up dominates on 2 cores). The compiled runs use the
``aot_eager`` backend (dynamo and AOTAutograd, no code generation) to stay within CI's budget;
``PLAIT_TEST_COMPILE_BACKEND=inductor`` runs it with inductor.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers")
pytest.importorskip("plait.zero_sharding")
pytest.importorskip("plait.offload_io")
pytest.importorskip("plait.ulysses_sp")
pytest.importorskip("plait.moe_layers")

from plait.kernels.testing import run_distributed  # noqa: E402
from plait.kernels.testing.dynamo import (  # noqa: E402
    break_reasons,
    breaks_inside,
    code_spans,
    file_spans,
    graph_break_sites,
    graph_count,
)
from plait.kernels.tolerances import tolerance  # noqa: E402
from plait.zero_sharding import ZeroConfig, zero_shard  # noqa: E402

STEPS, SEQ, LR = 3, 8, 1e-2
BACKEND = os.environ.get("PLAIT_TEST_COMPILE_BACKEND", "aot_eager")
FEATURES = ("zeropp", "offload", "sp", "ep")
SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, head_dim=16, vocab_size=64, max_position_embeddings=32)


def _hf_model(feature: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if feature == "ep":
        config = transformers.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2)
    else:
        config = transformers.LlamaConfig(**SHAPE)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config)


def _ids(rank: int) -> torch.Tensor:
    """This rank's batch, the same at every step (so the loss must go down)."""
    return torch.randint(0, SHAPE["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(rank))


def _build(feature: str) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, list]:
    """The sharded model, its optimizer, the mesh (Ulysses) and the extra code a block runs."""
    model, mesh, extra, kwargs = _hf_model(feature), None, [], {}
    config = dict(stage=3, param_persistence_threshold=0)
    if feature == "zeropp":  # hpZ needs a node boundary: every rank its own node
        from plait.zero_sharding.zeropp import ZeroPPConfig

        config["zeropp"] = ZeroPPConfig(hierarchical_partition_size=1, ranks_per_node=1)
    elif feature == "offload":
        from plait.offload_io import OffloadConfig, zero_placement

        kwargs["placement"] = zero_placement(OffloadConfig(device="cpu"))
    elif feature == "sp":
        from plait.kernels.mesh import make_mesh
        from plait.ulysses_sp import all_to_all, attention, hf

        mesh = make_mesh(dp=1, sp=2)
        hf.apply_ulysses(model, mesh)
        kwargs["mesh"] = mesh
        extra = file_spans(hf, attention, all_to_all)
    elif feature == "ep":
        from plait.moe_layers import (
            apply_expert_parallel,
            dense_parameters,
            dispatch,
            expert_parameters,
            layer,
            make_expert_parallel_groups,
            router,
        )
        from plait.moe_layers.hf import convert_hf_moe

        convert_hf_moe(model)
        groups = make_expert_parallel_groups(2)
        apply_expert_parallel(model, groups)
        kwargs["param_groups"] = [{"params": dense_parameters(model)},
                                  {"params": expert_parameters(model), "zero_group": groups.edp_group}]
        extra = file_spans(dispatch, layer, router)
    model.train()
    model, optimizer = zero_shard(model, torch.optim.AdamW, ZeroConfig(**config), lr=LR, **kwargs)
    return model, optimizer, mesh, extra


def _loss(model: torch.nn.Module, mesh: Any) -> tuple[torch.Tensor, Any]:
    """The loss to backward and its value (for Ulysses: the whole sequence's)."""
    ids = _ids(dist.get_rank() if mesh is None else 0)  # the sp ranks share one sequence
    if mesh is None:
        loss = model(input_ids=ids, labels=ids).loss
        return loss, loss
    from plait.ulysses_sp import shard_batch, sp_cross_entropy, sp_loss_value

    local = shard_batch({"input_ids": ids, "labels": ids}, mesh)
    logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
    share = sp_cross_entropy(logits, local["shift_labels"], mesh)
    return share, sp_loss_value(share, mesh)


def _train(feature: str, compiled: bool) -> dict[str, Any]:
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model, optimizer, mesh, extra = _build(feature)
    if compiled:
        for block in model.model.layers:
            block.compile(backend=BACKEND)
    losses, graphs = [], []
    with graph_break_sites() as sites:
        for _ in range(STEPS):
            loss, value = _loss(model, mesh)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(float(value))
            graphs.append(graph_count())
    spans = code_spans(model.model.layers[0]) + extra
    return dict(losses=losses, graphs=graphs, reasons=break_reasons(), inside=breaks_inside(sites, spans))


def _opcheck_rows_op() -> str:
    """torch's checks of ``plait::all_to_all_rows`` (schema, autograd registration, fake tensor),
    on real exchanges between the two ranks."""
    rows = torch.randn(5, 3, generator=torch.Generator().manual_seed(dist.get_rank()))
    send = [2, 3] if dist.get_rank() == 0 else [1, 4]
    recv = [2, 1] if dist.get_rank() == 0 else [3, 4]
    torch.library.opcheck(torch.ops.plait.all_to_all_rows.default,
                          (rows, send, recv, dist.group.WORLD.group_name, "opcheck"),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    return "ok"


def _campaign() -> dict[str, Any]:
    runs: dict[str, Any] = {"opcheck": _opcheck_rows_op()}
    runs.update({f"{feature} {kind}": _train(feature, kind == "compiled")
                 for feature in FEATURES for kind in ("eager", "compiled")})
    return runs


@pytest.fixture(scope="module")
def campaign() -> list[dict[str, Any]]:
    return run_distributed(_campaign, 2, timeout=300)


def test_rows_exchange_is_a_checked_custom_op(campaign):
    assert [runs["opcheck"] for runs in campaign] == ["ok", "ok"]


@pytest.mark.parametrize("feature", FEATURES)
def test_compiled_losses_equal_eager(campaign, feature):
    for rank, runs in enumerate(campaign):
        eager, compiled = runs[f"{feature} eager"], runs[f"{feature} compiled"]
        assert eager["losses"][-1] < eager["losses"][0], f"{feature}: the loss on a repeated batch does not go down"
        tolerance("compiled_losses_vs_eager", torch.float32).assert_close(
            torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), what=f"{feature} losses, rank {rank}")
        assert not eager["reasons"] and eager["graphs"] == [0] * STEPS


@pytest.mark.parametrize("feature", ["zeropp", "offload", "sp"])
def test_no_graph_break_inside_a_block_and_no_recompiles(campaign, feature):
    for rank, runs in enumerate(campaign):
        compiled = runs[f"{feature} compiled"]
        assert not compiled["inside"], f"{feature}, rank {rank}: graph breaks inside a block: {compiled['inside']}"
        assert compiled["reasons"], "stage 3's hooks run eagerly, as a break at their call"
        assert all("ZeroEngine._" in reason for reason in compiled["reasons"]), compiled["reasons"]
        graphs = compiled["graphs"]
        assert graphs[0] > 0 and graphs == [graphs[0]] * STEPS, f"{feature}: graphs compiled after step 1: {graphs}"


def test_expert_parallel_breaks_only_at_the_data_dependent_dispatch(campaign):
    from plait.moe_layers import dispatch

    for rank, runs in enumerate(campaign):
        compiled = runs["ep compiled"]
        outside = {path for path, _ in compiled["inside"]} - {dispatch.__file__}
        assert compiled["inside"] and not outside, f"rank {rank}: breaks inside a block outside the dispatch: {outside}"
        known = ("ZeroEngine._", "_exchange_counts", "aten.nonzero", "aten.repeat_interleave")
        unexpected = [reason for reason in compiled["reasons"] if not any(name in reason for name in known)]
        assert not unexpected, unexpected
        graphs = compiled["graphs"]
        assert graphs[1:] == [graphs[1]] * (STEPS - 1), f"ep: graphs compiled after step 2: {graphs}"
