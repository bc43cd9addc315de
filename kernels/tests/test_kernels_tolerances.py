"""The project's one tolerance table: lookups, missing entries, validation, every entry explained."""

from __future__ import annotations

import pytest
import torch

from plait.kernels.tolerances import TOLERANCES, Tolerance, tolerance


def test_rms_norm_has_forward_and_backward_entries_for_every_dtype():
    for op in ("rms_norm_fwd", "rms_norm_bwd"):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            entry = tolerance(op, dtype)
            assert entry is TOLERANCES[(op, dtype)]


def test_lower_precision_is_never_held_tighter_than_fp32():
    for (op, dtype), entry in TOLERANCES.items():
        if dtype in (torch.bfloat16, torch.float16) and (op, torch.float32) in TOLERANCES:
            assert entry.rtol >= TOLERANCES[(op, torch.float32)].rtol, (op, dtype)


def test_every_entry_is_keyed_and_explained():
    for key, entry in TOLERANCES.items():
        op, dtype = key
        assert isinstance(op, str) and op
        assert isinstance(dtype, torch.dtype)
        assert isinstance(entry, Tolerance)
        assert len(entry.reason) > 40, f"{key}: say where the two paths round differently"


def test_missing_entry_names_the_pair_and_the_fix():
    with pytest.raises(KeyError) as info:
        tolerance("rms_norm_fwd", torch.float64)
    message = str(info.value)
    assert "rms_norm_fwd" in message and "torch.float64" in message
    assert "add an entry" in message and "reason" in message
    assert "bfloat16" in message  # lists the dtypes the op does have

    with pytest.raises(KeyError, match="no entries at all"):
        tolerance("no_such_op", torch.float32)


@pytest.mark.parametrize("kwargs,match", [
    ({"atol": -1.0, "rtol": 0.0, "reason": "x"}, "atol"),
    ({"atol": 0.0, "rtol": float("nan"), "reason": "x"}, "rtol"),
    ({"atol": 0.0, "rtol": 0.0, "reason": "  "}, "reason"),
])
def test_tolerance_validates_its_fields(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Tolerance(**kwargs)


def test_tolerance_is_frozen():
    entry = tolerance("rms_norm_fwd", torch.float32)
    with pytest.raises(AttributeError):
        entry.atol = 1.0  # type: ignore[misc]


def test_assert_close_passes_inside_and_fails_outside_with_the_reason():
    entry = Tolerance(atol=0.0, rtol=1e-2, reason="one rounding of a bf16-ish value")
    expected = torch.tensor([1.0, 2.0, 4.0])
    entry.assert_close(expected * (1 + 5e-3), expected, what="inside")
    with pytest.raises(AssertionError) as info:
        entry.assert_close(expected * (1 + 5e-2), expected, what="outside")
    assert "outside" in str(info.value) and "one rounding of a bf16-ish value" in str(info.value)
