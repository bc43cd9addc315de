"""ZeRO's other features under ``torch.compile`` (cross-package): ZeRO++ (qwZ + qgZ + hpZ at stage 3,
qgZ at stages 1-2), CPU offload (plait-offload-io), Ulysses ``sp_size`` (plait-ulysses-sp) and MoE
``ep_size`` (plait-moe-layers), each at W=2 (gloo) on a tiny HF model, compiled per block as
torchtitan does (``block.compile()`` on every decoder layer) or whole (``model.compile()``),
against the same setup run eagerly.

Stage 3 per block, every feature; and ``MATRIX``: every feature at stages 1 and 2 (each stage with
both scopes across the features) and the whole model at stage 3. On every rank: the losses of
``STEPS`` training steps equal the eager ones within the tolerance table's
``compiled_losses_vs_eager``; no graph break is reported at a line of a block's code (its modules'
``forward`` and, for Ulysses and MoE, the files their exchanges run through); every break dynamo
counts is a call into a ZeRO hook (``torch.compiler.disable``, at a block's boundary), when the
blocks are compiled; and no graph is compiled after the first step. Compiled whole, a model can
break outside its blocks too: under Ulysses, the decoder stack's forward pre-hook exchanges the
positions to build the whole-sequence mask (a compiler-disabled all-gather and a data-dependent check of the positions),
once per forward. The ``MATRIX`` runs and the inductor run use one decoder layer (half the
compile time; a block is a block).

MoE token dispatch (which tokens go where, the row counts exchanged with the other ranks) is
data-dependent; under compile it runs as plait's ``ep_route`` / ``ep_dispatch_rows`` /
``ep_combine_rows`` custom ops on static, capacity-sized buffers (``plait.moe_layers.dispatch_ops``),
checked here with ``torch.library.opcheck`` as well.

Everything runs in one launch (process start-up dominates on 2 cores). The compiled runs use the
``aot_eager`` backend (dynamo and AOTAutograd, no code generation) to stay within CI's budget,
except one: MoE at stage 3 per block under inductor. ``PLAIT_TEST_COMPILE_BACKEND=inductor``
runs them all with inductor.
"""

from __future__ import annotations

import os
import time
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
# (feature, stage, compile scope) beyond stage 3 per block: every feature at stages 1 and 2, each
# stage with both scopes, and the whole model at stage 3; one launch runs them all.
MATRIX = (("zeropp", 1, "whole"), ("zeropp", 2, "block"), ("offload", 1, "block"), ("offload", 2, "whole"),
          ("sp", 1, "whole"), ("sp", 2, "block"), ("ep", 1, "block"), ("ep", 2, "whole"), ("ep", 3, "whole"))
INDUCTOR = "ep"  # the one feature also compiled by inductor (stage 3, per block, one layer): slow to compile on CPU
SHAPE = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, head_dim=16, vocab_size=64, max_position_embeddings=32)


def _hf_model(feature: str, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    shape = {**SHAPE, "num_hidden_layers": layers}
    if feature == "ep":
        config = transformers.MixtralConfig(**shape, num_local_experts=4, num_experts_per_tok=2)
    else:
        config = transformers.LlamaConfig(**shape)
    config._attn_implementation = "sdpa"
    return transformers.AutoModelForCausalLM.from_config(config)


def _ids(rank: int) -> torch.Tensor:
    """This rank's batch, the same at every step (so the loss must go down)."""
    return torch.randint(0, SHAPE["vocab_size"], (2, SEQ), generator=torch.Generator().manual_seed(rank))


def _build(feature: str, stage: int, layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, list]:
    """The sharded model, its optimizer, the mesh (Ulysses) and the extra code a block runs."""
    model, mesh, extra, kwargs = _hf_model(feature, layers), None, [], {}
    config: dict[str, Any] = dict(stage=stage, param_persistence_threshold=0)
    if feature == "zeropp":  # hpZ needs a node boundary: every rank its own node
        from plait.zero_sharding.zeropp import ZeroPPConfig

        # Stages 1 and 2 gather no parameters: only qgZ (the quantized gradient reduce) applies.
        config["zeropp"] = (ZeroPPConfig(hierarchical_partition_size=1, ranks_per_node=1) if stage == 3 else
                            ZeroPPConfig(quantized_weights=False, hierarchical_partition_size=None, ranks_per_node=1))
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
            dispatch_ops,
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
        extra = file_spans(dispatch, dispatch_ops, layer, router)
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


def _train(feature: str, compiled: str | None, stage: int = 3, backend: str = BACKEND,
           layers: int = SHAPE["num_hidden_layers"]) -> dict[str, Any]:
    """``STEPS`` steps eagerly (``compiled=None``) or compiled per ``"block"`` or ``"whole"``."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    cpu = time.process_time()
    model, optimizer, mesh, extra = _build(feature, stage, layers)
    if compiled == "block":
        for block in model.model.layers:
            block.compile(backend=backend)
    elif compiled == "whole":
        model.compile(backend=backend)
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
    return dict(losses=losses, graphs=graphs, reasons=break_reasons(), inside=breaks_inside(sites, spans),
                cpu_seconds=time.process_time() - cpu)


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


def _opcheck_expert_parallel_ops() -> str:
    """torch's checks of the compiled expert-parallel dispatch ops, on real exchanges (4 experts,
    2 per rank; rank 1 drops its last assignment)."""
    from plait.moe_layers import dispatch_ops  # noqa: F401  (registers the ops)

    rank, group = dist.get_rank(), dist.group.WORLD.group_name
    counts = torch.tensor([1, 2, 0, 2] if rank == 0 else [2, 0, 1, 0])
    rows = torch.randn(5, 3, generator=torch.Generator().manual_seed(rank))
    checks = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(torch.ops.plait.ep_route.default, (counts, 5, group, 2, "opcheck"),
                          test_utils=("test_schema", "test_faketensor"))
    recv_counts, _, order = torch.ops.plait.ep_route(counts, 5, group, 2, "opcheck")
    torch.library.opcheck(torch.ops.plait.ep_dispatch_rows.default,
                          (rows, counts, recv_counts, order, group, "opcheck"), test_utils=checks)
    out = torch.randn(order.shape[0], 3)
    torch.library.opcheck(torch.ops.plait.ep_combine_rows.default,
                          (out, counts, recv_counts, order, 5, group, "opcheck"), test_utils=checks)
    return "ok"


def _campaign() -> dict[str, Any]:
    runs: dict[str, Any] = {"opcheck": _opcheck_rows_op(), "ep opcheck": _opcheck_expert_parallel_ops()}
    for feature in FEATURES:
        runs[f"{feature} eager"] = _train(feature, None)
        runs[f"{feature} compiled"] = _train(feature, "block")
    for feature, stage, how in MATRIX:  # one decoder layer: half the compile time, the same checks
        if f"{feature} {stage} eager" not in runs:
            runs[f"{feature} {stage} eager"] = _train(feature, None, stage, layers=1)
        runs[f"{feature} {stage} {how}"] = _train(feature, how, stage, layers=1)
    runs[f"{INDUCTOR} inductor"] = _train(INDUCTOR, "block", backend="inductor", layers=1)
    return runs


@pytest.fixture(scope="module")
def campaign() -> list[dict[str, Any]]:
    return run_distributed(_campaign, 2, timeout=600)


def test_rows_exchange_is_a_checked_custom_op(campaign):
    assert [runs["opcheck"] for runs in campaign] == ["ok", "ok"]


def test_expert_parallel_dispatch_ops_are_checked_custom_ops(campaign):
    assert [runs["ep opcheck"] for runs in campaign] == ["ok", "ok"]


@pytest.mark.parametrize("feature", FEATURES)
def test_compiled_losses_equal_eager(campaign, feature):
    for rank, runs in enumerate(campaign):
        eager, compiled = runs[f"{feature} eager"], runs[f"{feature} compiled"]
        assert eager["losses"][-1] < eager["losses"][0], f"{feature}: the loss on a repeated batch does not go down"
        tolerance("compiled_losses_vs_eager", torch.float32).assert_close(
            torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), what=f"{feature} losses, rank {rank}")
        assert not eager["reasons"] and eager["graphs"] == [0] * STEPS


@pytest.mark.parametrize("feature", FEATURES)
def test_no_graph_break_inside_a_block_and_no_recompiles(campaign, feature):
    for rank, runs in enumerate(campaign):
        compiled = runs[f"{feature} compiled"]
        assert not compiled["inside"], f"{feature}, rank {rank}: graph breaks inside a block: {compiled['inside']}"
        assert compiled["reasons"], "stage 3's hooks run eagerly, as a break at their call"
        assert all("ZeroEngine._" in reason for reason in compiled["reasons"]), compiled["reasons"]
        graphs = compiled["graphs"]
        assert graphs[0] > 0 and graphs == [graphs[0]] * STEPS, f"{feature}: graphs compiled after step 1: {graphs}"


@pytest.mark.parametrize("feature,stage,how", MATRIX, ids=[f"{f}-{s}-{h}" for f, s, h in MATRIX])
def test_stages_and_scopes_compile_without_breaks_in_blocks_and_equal_eager(campaign, feature, stage, how):
    for rank, runs in enumerate(campaign):
        eager, compiled = runs[f"{feature} {stage} eager"], runs[f"{feature} {stage} {how}"]
        what = f"{feature}, stage {stage}, compiled {how}, rank {rank}"
        tolerance("compiled_losses_vs_eager", torch.float32).assert_close(
            torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), what=f"{what}: losses")
        assert not compiled["inside"], f"{what}: graph breaks inside a block: {compiled['inside']}"
        if how == "block":  # the model around the blocks runs eagerly: every break is a hook call
            others = [reason for reason in compiled["reasons"] if "ZeroEngine._" not in reason]
            assert not others, f"{what}: graph breaks other than at ZeRO's hooks: {others}"
        graphs = compiled["graphs"]
        assert graphs[0] > 0 and graphs == [graphs[0]] * STEPS, f"{what}: graphs compiled after step 1: {graphs}"


def test_inductor_compiled_block_losses_equal_eager(campaign):
    for rank, runs in enumerate(campaign):
        compiled, eager = runs[f"{INDUCTOR} inductor"], runs[f"{INDUCTOR} 3 eager"]
        tolerance("compiled_losses_vs_eager", torch.float32).assert_close(
            torch.tensor(compiled["losses"]), torch.tensor(eager["losses"]), what=f"inductor losses, rank {rank}")
        assert not compiled["inside"], f"rank {rank}: graph breaks inside a block: {compiled['inside']}"
        graphs = compiled["graphs"]
        assert graphs == [graphs[0]] * STEPS, f"graphs compiled after step 1: {graphs}"
