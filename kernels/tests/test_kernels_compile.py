"""plait's MoE grouped-GEMM op as a ``torch.library`` custom op: ``opcheck`` on small shapes, and
under ``torch.compile(fullgraph=True)`` (inductor on CPU) eager's outputs and gradients, bitwise;
the whole routed MoE step (permute, grouped GEMMs, combine) compiles into one graph."""

from __future__ import annotations

import pytest
import torch

from plait.kernels.ops import combine_rows, grouped_gated_mlp, permute_by_expert, permute_tokens

OPCHECK_TESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _moe_inputs(rows=12, experts=4, hidden=16, inter=8, *, empty_expert=True):
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, experts - (1 if empty_expert else 0), (rows,), generator=gen)
    counts = torch.bincount(ids, minlength=experts)
    x = torch.randn(rows, hidden, generator=gen)
    w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen) * 0.3
    w_down = torch.randn(experts, hidden, inter, generator=gen) * 0.3
    return x, counts, w_gate_up, w_down


def _grads_of(fn, *tensors):
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors]
    out = fn(*leaves)
    out.square().sum().backward()
    return out.detach(), [leaf.grad for leaf in leaves if leaf.is_floating_point()]


def _assert_compiled_equals_eager(fn, *tensors, backend="inductor"):
    eager_out, eager_grads = _grads_of(fn, *tensors)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=False, backend=backend)
    compiled_out, compiled_grads = _grads_of(compiled, *tensors)
    assert torch.equal(compiled_out, eager_out)
    assert len(compiled_grads) == len(eager_grads)
    for got, want in zip(compiled_grads, eager_grads):
        assert torch.equal(got, want)


@pytest.mark.parametrize("activation", ["silu", "gelu_tanh"])
def test_grouped_gated_mlp_opcheck(activation):
    x, counts, w_gate_up, w_down = _moe_inputs()
    args = (x.requires_grad_(), counts, w_gate_up.requires_grad_(), w_down.requires_grad_(), activation, "input",
            False)
    torch.library.opcheck(torch.ops.plait.grouped_gated_mlp.default, args, test_utils=OPCHECK_TESTS)


def test_grouped_gated_mlp_compiled_equals_eager_bitwise():
    x, counts, w_gate_up, w_down = _moe_inputs()

    def fn(x, w_gate_up, w_down):
        return grouped_gated_mlp(x, counts, w_gate_up, w_down, activation="silu")

    _assert_compiled_equals_eager(fn, x, w_gate_up, w_down)


def test_grouped_gated_mlp_op_backward_equals_eager_autograd_bitwise():
    """The op's registered backward (gate_up recomputed) gives the autograd Function's bits."""
    x, counts, w_gate_up, w_down = _moe_inputs(rows=40, hidden=32, inter=16)
    eager_out, eager_grads = _grads_of(lambda *t: grouped_gated_mlp(t[0], counts, t[1], t[2]), x, w_gate_up, w_down)
    op_out, op_grads = _grads_of(
        lambda *t: torch.ops.plait.grouped_gated_mlp(t[0], counts, t[1], t[2], "silu", "input", False),
        x, w_gate_up, w_down)
    assert torch.equal(op_out, eager_out)
    for got, want in zip(op_grads, eager_grads):
        assert torch.equal(got, want)


def test_grouped_gated_mlp_op_refuses_counts_that_miss_rows():
    x, counts, w_gate_up, w_down = _moe_inputs()
    counts = counts.clone()
    counts[0] += 1
    with pytest.raises(ValueError, match="counts sum to 13 but x has 12 rows"):
        torch.ops.plait.grouped_gated_mlp(x, counts, w_gate_up, w_down, "silu", "input", False)


def test_moe_permutation_and_grouped_mlp_compile_into_one_graph():
    """Routing ids to the combined output (permute, grouped GEMMs, combine): one graph, no break.

    aot_eager (dynamo and AOTAutograd, no code generation): inductor would fuse the combine's
    plain torch ops and round them differently, and would cost CI a second C++ build."""
    x, _, w_gate_up, w_down = _moe_inputs(rows=10)
    ids = torch.tensor([[0, 2], [1, 2], [2, 0], [1, 0], [2, 1], [0, 1], [1, 2], [0, 2], [2, 1], [0, 1]])
    weights = torch.rand(10, 2, generator=torch.Generator().manual_seed(1))

    def fn(x, w_gate_up, w_down, weights):
        order, counts = permute_by_expert(ids.reshape(-1), w_gate_up.shape[0])
        token = order // 2
        out = grouped_gated_mlp(permute_tokens(x, token), counts, w_gate_up, w_down)
        return combine_rows(out, token, weights.reshape(-1).index_select(0, order), x.shape[0])

    _assert_compiled_equals_eager(fn, x, w_gate_up, w_down, weights, backend="aot_eager")
