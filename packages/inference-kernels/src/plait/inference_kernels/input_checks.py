"""Checks every inference op runs on its inputs before any kernel launches.

The rule of the package: bad input is refused with an error that names the argument, the bad
value and the fix, before a launch, so a GPU never turns a wrong shape into a silently wrong
result or an out-of-bounds read. Index checks (expert ids, block tables, cache slots) need the
values, which on CUDA costs a device-to-host copy; ops take ``check_bounds=True`` by default and a
caller that already guarantees its indices (a serving engine, CUDA-graph capture) turns it off.
"""

from __future__ import annotations

import torch

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_float(name: str, tensor: torch.Tensor, *, ndim: int | None = None) -> None:
    """Refuse a tensor whose dtype is not fp32/bf16/fp16 or whose rank is not ``ndim``.

    Args:
        name: the argument's name, used in the message.
        tensor: the argument.
        ndim: the required number of dimensions, or ``None`` for any.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: wrong dtype or rank.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"{name} has dtype {tensor.dtype}; supported dtypes are float32, bfloat16 and float16. "
            f"Cast it with .to(torch.bfloat16) (or float16/float32)."
        )
    if ndim is not None and tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}.")


def check_index(name: str, tensor: torch.Tensor, *, ndim: int) -> None:
    """Refuse an index tensor that is not int32/int64 or has the wrong rank.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: wrong dtype or rank.
    """
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} has dtype {tensor.dtype}; it must be torch.int32 or torch.int64.")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(tensor.shape)}.")


def check_same(what: str, **tensors: torch.Tensor) -> None:
    """Refuse tensors that disagree on ``what`` (``"dtype"`` or ``"device"``).

    Raises:
        ValueError: the named tensors differ; the message lists each one's value.
    """
    items = iter(tensors.values())
    first = getattr(next(items), what)
    if any(getattr(t, what) != first for t in items):
        listing = ", ".join(f"{name}={getattr(t, what)}" for name, t in tensors.items())
        raise ValueError(f"these arguments must share one {what}: {listing}.")


def bounds_checks_possible(tensor: torch.Tensor) -> bool:
    """Whether reading index values back is allowed now (never during CUDA-graph capture)."""
    return not (tensor.is_cuda and torch.cuda.is_current_stream_capturing())


def check_range(name: str, values: torch.Tensor, low: int, high: int, *, fix: str) -> None:
    """Refuse index values outside ``[low, high)``; a no-op on an empty tensor.

    Args:
        name: the argument's name.
        values: the indices to check (any shape).
        low, high: the allowed half-open range.
        fix: what the caller should do, appended to the message.

    Raises:
        ValueError: some value is out of range; the message gives the smallest and largest.
    """
    check_ranges((name, values, low, high, fix))


def check_ranges(*specs: tuple[str, torch.Tensor, int, int, str]) -> None:
    """:func:`check_range` for several tensors with one device-to-host read for all of them.

    Args:
        *specs: ``(name, values, low, high, fix)`` tuples.

    Raises:
        ValueError: for the first spec with a value outside its range.
    """
    live = [spec for spec in specs if spec[1].numel() and bounds_checks_possible(spec[1])]
    if not live:
        return
    if live[0][1].is_cuda:
        # One device-to-host copy for all the extremes: each read is a sync on CUDA.
        extremes = torch.stack([torch.stack(torch.aminmax(spec[1])).long() for spec in live]).tolist()
    else:
        # On CPU a read is free and every extra op costs dispatch time (which dominates at decode sizes).
        extremes = []
        for spec in live:
            smallest, largest = torch.aminmax(spec[1])
            extremes.append((int(smallest), int(largest)))
    for (name, _, low, high, fix), (smallest, largest) in zip(live, extremes, strict=True):
        if smallest < low or largest >= high:
            raise ValueError(
                f"{name} holds values in [{smallest}, {largest}] but must lie in [{low}, {high}); {fix}"
            )


def is_power_of_two(value: int) -> bool:
    """Whether ``value`` is a positive power of two."""
    return value > 0 and value & (value - 1) == 0


def next_power_of_two(value: int) -> int:
    """The smallest power of two >= ``value`` (1 for values <= 1)."""
    return 1 if value <= 1 else 1 << (value - 1).bit_length()
