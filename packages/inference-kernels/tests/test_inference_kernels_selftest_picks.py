"""The GPU self-test's top-k routing check accepts a different pick only where logits tie: random
bf16 logits round onto equal values often enough that the kernel and ``torch.topk`` may break a tie
differently, and either pick is a correct top-k; any other difference still fails the row."""

from __future__ import annotations

import torch

from plait.inference_kernels.selftest import _same_picks


def test_equal_ids_and_tied_picks_agree_other_picks_do_not() -> None:
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.5], [0.1, 0.3, 0.2, 0.4]], dtype=torch.bfloat16)
    ref = torch.tensor([[2], [3]])
    assert _same_picks(logits, ref.clone(), ref)
    assert _same_picks(logits, torch.tensor([[1], [3]]), ref)  # 1 ties with 2 in the first token
    assert not _same_picks(logits, torch.tensor([[0], [3]]), ref)  # 0 is not a top-1 logit
    assert not _same_picks(logits, torch.tensor([[2], [1]]), ref)  # the second token's pick differs
