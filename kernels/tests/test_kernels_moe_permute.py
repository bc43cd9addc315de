"""The MoE token permutation op unit: permute_tokens (dispatch) and combine_rows (combine), torch
reference and Triton kernels (forward and backward; the interpreter on CPU), the block alignment
the grouped GEMM takes, and bad input refused."""

from __future__ import annotations

import pytest
import torch

from plait.kernels.ops import (
    align_tokens_to_blocks,
    combine_rows,
    combine_rows_reference,
    permute_by_expert,
    permute_tokens,
    permute_tokens_reference,
)

# Token of each row: token 3 three times (three rows summed), token 2 never, token 5 once.
TOKEN_INDEX = [3, 0, 3, 5, 1, 1, 3, 4]
TOKENS, HIDDEN = 6, 1100  # a row wider than one 1024-column program


def _inputs(dtype: torch.dtype, device: str):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=gen).to(device, dtype)
    rows = torch.randn(len(TOKEN_INDEX), HIDDEN, generator=gen).to(device, dtype)
    weights = torch.rand(len(TOKEN_INDEX), generator=gen).to(device)
    return x, rows, weights, torch.tensor(TOKEN_INDEX, device=device)


def test_reference_is_the_formula() -> None:
    x, rows, weights, index = _inputs(torch.float64, "cpu")
    assert torch.equal(permute_tokens(x, index), torch.stack([x[t] for t in TOKEN_INDEX]))
    expected = torch.zeros(TOKENS, HIDDEN, dtype=torch.float64)
    for i, t in enumerate(TOKEN_INDEX):
        expected[t] += weights[i].double() * rows[i]
    torch.testing.assert_close(combine_rows(rows, index, weights, TOKENS), expected)
    assert not combine_rows(rows, index, weights, TOKENS)[2].any()  # a token without rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_matches_reference_forward_and_backward(triton_backend, dtype: torch.dtype) -> None:
    """Gather and scatter-add kernels: the same values as the reference (fp32 sums of at most a few
    rows: equal up to the order of fp32 additions; bitwise where a token has <= 2 rows)."""
    x, rows, weights, index = _inputs(dtype, triton_backend)
    ours = [t.clone().requires_grad_() for t in (x, rows, weights)]
    refs = [t.detach().cpu().clone().requires_grad_() for t in (x, rows, weights)]
    permuted = permute_tokens(ours[0], index)
    combined = combine_rows(ours[1], index, ours[2], TOKENS)
    ref_permuted = permute_tokens_reference(refs[0], index.cpu())
    ref_combined = combine_rows_reference(refs[1], index.cpu(), refs[2], TOKENS)
    assert torch.equal(permuted.cpu(), ref_permuted)
    gen = torch.Generator().manual_seed(1)
    probe_p = torch.randn(permuted.shape, generator=gen).to(dtype)
    probe_c = torch.randn(combined.shape, generator=gen).to(dtype)
    loss = (permuted.cpu().float() * probe_p).sum() + (combined.cpu().float() * probe_c).sum()
    ref_loss = (ref_permuted.float() * probe_p).sum() + (ref_combined.float() * probe_c).sum()
    grads = torch.autograd.grad(loss, ours)
    ref_grads = torch.autograd.grad(ref_loss, refs)
    ulp = 0 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(combined.cpu(), ref_combined, atol=1e-6, rtol=max(ulp, 1e-6))
    for name, got, want in zip(("x", "rows", "weights"), grads, ref_grads):
        # x's gradient: the kernel sums a token's rows in fp32, the reference's index_add in dtype.
        torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=max(2 * ulp, 1e-5), msg=name)
    two_rows = [t for t in range(TOKENS) if TOKEN_INDEX.count(t) <= 2]
    assert torch.equal(combined.cpu()[two_rows], ref_combined[two_rows]) or dtype != torch.float32


def test_alignment_pads_each_expert_to_whole_tiles() -> None:
    ids = torch.tensor([[3, 0], [3, 1], [0, 3], [5, 3], [3, 2]], dtype=torch.int32)
    order, counts = permute_by_expert(ids.reshape(-1), 6)
    a = align_tokens_to_blocks(ids, 6, 4)
    real = a.sorted_ids[a.sorted_ids < ids.numel()]
    assert torch.equal(real.long(), order)  # same stable order as permute_by_expert, padding removed
    assert int(a.num_padded) == int(((counts + 3) // 4 * 4).sum())


def test_bad_input_refused() -> None:
    x, rows, weights, index = _inputs(torch.float32, "cpu")
    with pytest.raises(ValueError, match="token_index must be a 1-D integer tensor"):
        permute_tokens(x, index.float())
    with pytest.raises(ValueError, match="x must be a 2-D floating-point tensor"):
        permute_tokens(x[0], index)
    with pytest.raises(ValueError, match="weights and token_index must be \\[N=8\\]"):
        combine_rows(rows, index, weights[:3], TOKENS)
    with pytest.raises(ValueError, match="topk_ids must be a 2-D"):
        align_tokens_to_blocks(index, 6, 4)
    with pytest.raises(ValueError, match="block_m=0"):
        align_tokens_to_blocks(index.view(-1, 1), 6, 0)
