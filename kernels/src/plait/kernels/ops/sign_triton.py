"""Triton kernels of the 1-bit sign ops: pack, unpack, and the sign/error pass of the compression.

Grid, recompute and constants - read this before changing anything below.

Format: the one of :mod:`plait.kernels.ops.sign` (element ``8j + i`` is bit ``i`` of byte ``j``, 1
for ``>= 0``, NaN 0, a partial last byte padded with 1 bits), produced bit for bit.

All three kernels: grid ``(ceil(bytes / BYTES),)``. A program owns ``BYTES`` consecutive packed
bytes and sees their ``8 x BYTES`` elements as a ``[BYTES, 8]`` tile, so a row is one byte: the
pack is a shift of each column by its index and a sum along the row (the eight bits are disjoint,
so the sum is the OR), and the unpack is the same shifts the other way. Elements past ``N`` (the
partial last byte, and the rows past the end) are masked: packing gives them bit 1, unpacking
writes nothing for them.

* ``_pack_kernel``: x -> uint8 bytes. fp32 and fp64 are compared with 0 in their own dtype (fp64
  is not narrowed: a tiny negative would become -0.0, a 1 bit); bf16 and fp16 are widened to fp32
  first, which is exact and keeps every sign (the CPU interpreter cannot compare bf16 itself).
* ``_unpack_kernel``: bytes -> the bits as 0/1 uint8 (the caller views them as bool), as
  ``+-1.0`` fp32 (``2b - 1``, exact), or as the decoded values ``+-scale`` (the scale read from
  device memory), written straight into the caller's buffer.
* ``_sign_error_kernel``: the second pass of ``compress_with_error_feedback``. The first pass,
  ``c = x + error`` (in the error buffer) and ``scale = ||c||_2 / sqrt(n)``, is torch's, the same
  calls as the reference's: the scale is a whole-tensor reduction whose bits depend on its
  summation order, and reusing torch's keeps the Triton path bitwise equal to the reference on the
  same device, so an optimizer's trajectory does not depend on the backend. That costs one read of
  ``c`` (4n bytes of about 24n in all) against a kernel that also summed per-program partial
  squares. This kernel then reads c once and writes the packed signs (n / 8 bytes) and
  ``error = c - scale * sign(c)`` in place, written as ``c - scale`` or ``c + scale`` (IEEE addition
  of ``+scale`` is subtraction of ``-scale``, bit for bit the reference's ``c - (+-scale)``). The
  scale is read from device memory: no host synchronisation.

Constants: ``BYTES = 512`` bytes per program, i.e. 4096 elements (16 KiB of fp32 in flight with
4 warps: 32 elements a thread, enough outstanding loads to stream, few registers). Untuned: written
without a GPU; retune with a benchmark on one. Offsets are int64 so tensors above 2^31 elements
index correctly.

CPU interpreter (``TRITON_INTERPRET=1``): how the tests run these kernels without a GPU; it must be
set before the process imports triton (``check_triton_launch_mode`` says so otherwise). The only
rounding float operation is ``c -+ scale``, one IEEE addition, correctly rounded on a GPU and in the
interpreter alike, with no multiply to contract into an FMA (the unpack's ``2b - 1`` and ``+-scale``
are exact), so the interpreter and a GPU give the same bits.

Triton is imported here and only here, so ``plait.kernels`` imports on machines without Triton.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from plait.kernels.dispatch import check_triton_launch_mode
from plait.kernels.ops.sign import packed_numel

BYTES = 512
_NUM_WARPS = 4


@triton.jit
def _pack_kernel(X, OUT, N, NBYTES, WIDEN: tl.constexpr, BYTES: tl.constexpr):  # noqa: N803 - Triton style
    rows = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    lanes = tl.arange(0, 8)
    elems = rows[:, None] * 8 + lanes[None, :]
    inside = elems < N
    x = tl.load(X + elems, mask=inside, other=0.0)
    if WIDEN:  # 16-bit floats compared in fp32 (exact, signs and NaN kept; the interpreter needs it)
        x = x.to(tl.float32)
    bits = tl.where(inside, (x >= 0).to(tl.int32), 1)  # the partial last byte is padded with 1 bits
    packed = tl.sum(bits << lanes[None, :], axis=1)
    tl.store(OUT + rows, packed.to(tl.uint8), mask=rows < NBYTES)


@triton.jit
def _unpack_kernel(P, SCALE, OUT, N, NBYTES, AS_SIGNS: tl.constexpr, HAS_SCALE: tl.constexpr,  # noqa: N803
                   BYTES: tl.constexpr):  # noqa: N803 - Triton convention: capitals
    rows = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    lanes = tl.arange(0, 8)
    elems = rows[:, None] * 8 + lanes[None, :]
    packed = tl.load(P + rows, mask=rows < NBYTES, other=0).to(tl.int32)
    bits = (packed[:, None] >> lanes[None, :]) & 1
    if HAS_SCALE:  # the decoded values +-scale (scale times +-1: exact)
        scale = tl.load(SCALE)
        tl.store(OUT + elems, tl.where(bits != 0, scale, -scale), mask=elems < N)
    elif AS_SIGNS:
        tl.store(OUT + elems, bits.to(tl.float32) * 2.0 - 1.0, mask=elems < N)
    else:
        tl.store(OUT + elems, bits.to(tl.uint8), mask=elems < N)


@triton.jit
def _sign_error_kernel(C, SCALE, OUT, N, NBYTES, BYTES: tl.constexpr):  # noqa: N803 - Triton convention
    rows = tl.program_id(0).to(tl.int64) * BYTES + tl.arange(0, BYTES)
    lanes = tl.arange(0, 8)
    elems = rows[:, None] * 8 + lanes[None, :]
    inside = elems < N
    c = tl.load(C + elems, mask=inside, other=0.0)
    scale = tl.load(SCALE)
    positive = c >= 0
    bits = tl.where(inside, positive.to(tl.int32), 1)
    tl.store(OUT + rows, tl.sum(bits << lanes[None, :], axis=1).to(tl.uint8), mask=rows < NBYTES)
    tl.store(C + elems, tl.where(positive, c - scale, c + scale), mask=inside)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """``t`` read flat in row-major order (a copy only when it is not contiguous)."""
    return t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1)


def _grid(nbytes: int) -> tuple[int]:
    return (triton.cdiv(nbytes, BYTES),)


def pack_signs_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton :func:`~plait.kernels.ops.sign.pack_signs` (x validated, at least one element)."""
    check_triton_launch_mode(_pack_kernel, x, op="sign pack")
    flat = _flat(x)
    nbytes = packed_numel(flat.numel())
    out = torch.empty(nbytes, dtype=torch.uint8, device=x.device)
    with _device_guard(x):
        _pack_kernel[_grid(nbytes)](flat, out, flat.numel(), nbytes, WIDEN=flat.element_size() < 4, BYTES=BYTES,
                                    num_warps=_NUM_WARPS)
    return out


def unpack_triton(packed: torch.Tensor, numel: int, *, as_signs: bool, scale: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton :func:`~plait.kernels.ops.sign.unpack_bits` (``as_signs=False``: ``bool [numel]``),
    :func:`~plait.kernels.ops.sign.unpack_signs` (``as_signs=True``: fp32 ``+-1.0``) or, with a
    ``scale`` (a one-element fp32 tensor on packed's device), ``unpack_scaled_signs`` (fp32
    ``+-scale``, into ``out`` when given: fp32, ``numel`` elements); arguments validated,
    ``numel >= 1``."""
    check_triton_launch_mode(_unpack_kernel, packed, op="sign unpack")
    flat = _flat(packed)
    nbytes = packed_numel(numel)  # only the bytes that hold the first numel signs are read
    floats = as_signs or scale is not None
    target = out if out is not None and out.is_contiguous() else None
    if target is None:
        target = torch.empty(numel, dtype=torch.float32 if floats else torch.uint8, device=packed.device)
    with _device_guard(packed):
        _unpack_kernel[_grid(nbytes)](flat, flat if scale is None else scale.reshape(()), target, numel, nbytes,
                                      AS_SIGNS=floats, HAS_SCALE=scale is not None, BYTES=BYTES,
                                      num_warps=_NUM_WARPS)
    if out is not None and target is not out:  # a strided out: written through a contiguous buffer
        return out.copy_(target.view(out.shape))
    return target if floats else target.view(torch.bool)


def sign_and_error_triton(compensated: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fused second pass of :func:`~plait.kernels.ops.sign.compress_with_error_feedback`.

    Args:
        compensated: the flat fp32 error buffer holding ``c = x + error`` (at least one element),
            overwritten with ``c - scale * sign(c)``.
        scale: the 0-d fp32 scale ``||c||_2 / sqrt(n)`` on the same device.

    Returns:
        ``uint8 [ceil(n / 8)]``: the packed signs of ``c``.
    """
    check_triton_launch_mode(_sign_error_kernel, compensated, op="1-bit compression")
    buffer = compensated if compensated.is_contiguous() else compensated.contiguous()  # a strided view: via a copy
    n = buffer.numel()
    nbytes = packed_numel(n)
    out = torch.empty(nbytes, dtype=torch.uint8, device=buffer.device)
    with _device_guard(buffer):
        _sign_error_kernel[_grid(nbytes)](buffer, scale, out, n, nbytes, BYTES=BYTES, num_warps=_NUM_WARPS)
    if buffer is not compensated:
        compensated.copy_(buffer)
    return out


def _device_guard(t: torch.Tensor) -> contextlib.AbstractContextManager:
    # Triton launches on the current CUDA device; make it the tensor's device for the launch.
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()
