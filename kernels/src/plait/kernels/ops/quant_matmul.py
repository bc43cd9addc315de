"""Weight-only quantized matmul: weight formats, quantize, dequantize, and ``y = x @ W^T``.

Decode is memory-bound: the weights' bytes set its speed, so serving stacks keep Linear weights
as small integer codes plus scales and dequantize them inside the matmul. This module is the op
(the op pattern of docs/conventions.md): validate, pick a backend with
:func:`plait.kernels.dispatch.select_backend`, and run the Triton kernel
(``quant_matmul_triton``, imported only when chosen), a matmul torch ships for CPU where one fits,
or :func:`quant_matmul_reference` (dequantize, then matmul in fp32), which is the test oracle.

Schemes (``W`` is ``[N, K]``: N output features, K input features):

* ``"int8"``: symmetric, one fp32 scale per output channel. ``scale = absmax(row) / 127``,
  ``code = round_half_even(w / scale)`` clamped to [-127, 127], codes ``int8 [N, K]``,
  ``scales float32 [N, 1]``; ``w ~ code * scale``.
* ``"int4"``: group-wise over K (``group_size`` in 32..128, a power of two dividing K). Codes are
  unsigned 4-bit values ``q`` in [0, 15] packed two a byte, element ``2i`` in the low nibble
  (``uint8 [N, K / 2]``), ``scales float32 [N, K / group_size]``, and ``w ~ (q - z) * scale``.
  Symmetric: ``z = 8`` for every group (no zeros tensor), ``scale = absmax / 7`` (code 0, i.e.
  -8, is never produced). Asymmetric: ``scale = (max - min) / 15`` with the range widened to hold
  0, ``z = round(-min / scale)`` in [0, 15] stored as ``uint8 [N, K / group_size]``.
* ``"fp6"``: FP6-LLM's e3m2 (1 sign, 3 exponent bits with bias 3, 2 mantissa bits, subnormals,
  no inf/NaN; largest magnitude 28), one fp32 scale per output channel (``absmax / 28``), the
  6-bit codes packed four into three bytes (``uint8 [N, 3 K / 4]``, element ``4i + j`` in bits
  ``6j .. 6j + 5`` of the little-endian 24-bit word). Round to nearest, ties to the even code.

An all-zero row or group has scale 0 and dequantizes to exact zeros. Weights with inf or NaN are
refused when quantizing (a served model must not silently carry them).
"""

from __future__ import annotations

import dataclasses

import torch

from plait.kernels import dispatch
from plait.kernels.ops import quant_matmul_cpu

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
SCHEMES = ("int8", "int4", "fp6")
INT4_GROUP_SIZES = (32, 64, 128)
FP6_MAX = 28.0
DENSE_CHUNK_ROWS = 128
"""Weight rows :func:`dense_matmul_cpu` dequantizes at a time: 128 x K fp32 (384 KiB at K = 768)
stays in a core's L2 between the dequantize and the GEMM that reads it. Measured on the
benchmark's Linears (2048 x 768, 128 input rows, weights rotated past L3): 128 rows beat 64 and
256, and beat dequantizing the whole weight first by about 2x for int8."""


def _fp6_values() -> torch.Tensor:
    """The 64 e3m2 values, indexed by code (sign bit 5, exponent bits 2-4, mantissa bits 0-1)."""
    out = []
    for code in range(64):
        sign = -1.0 if code & 32 else 1.0
        exp, man = (code >> 2) & 7, code & 3
        mag = (man / 4) * 2.0 ** (1 - 3) if exp == 0 else (1 + man / 4) * 2.0 ** (exp - 3)
        out.append(sign * mag)
    return torch.tensor(out, dtype=torch.float32)


FP6_VALUES = _fp6_values()


@dataclasses.dataclass(frozen=True, kw_only=True)
class QuantScheme:
    """How a weight is quantized.

    Attributes:
        kind: ``"int8"`` (per output channel), ``"int4"`` (group-wise) or ``"fp6"`` (e3m2, per channel).
        group_size: elements of K per int4 scale (32, 64 or 128); must be None for int8 and fp6.
        symmetric: int4 only: True for ``z = 8``, False for a per-group zero point. int8 and fp6
            are always symmetric.
    """

    kind: str
    group_size: int | None = None
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.kind not in SCHEMES:
            raise ValueError(f"QuantScheme.kind={self.kind!r} is not supported; use one of {', '.join(SCHEMES)}.")
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"QuantScheme.symmetric={self.symmetric!r} must be True or False.")
        if self.kind == "int4":
            if isinstance(self.group_size, bool) or self.group_size not in INT4_GROUP_SIZES:
                raise ValueError(
                    f"QuantScheme.group_size={self.group_size!r} is not supported for int4; pass one of "
                    f"{', '.join(map(str, INT4_GROUP_SIZES))} (64 is a good default)."
                )
        else:
            if self.group_size is not None:
                raise ValueError(
                    f"QuantScheme.group_size={self.group_size!r} with kind={self.kind!r}: {self.kind} uses one "
                    "scale per output channel; leave group_size=None."
                )
            if not self.symmetric:
                raise ValueError(f"QuantScheme.symmetric=False with kind={self.kind!r}: only int4 has zero points.")

    def to_json(self) -> dict:
        """The scheme as a plain JSON-able dict (stored in checkpoints and exports)."""
        return {"kind": self.kind, "group_size": self.group_size, "symmetric": self.symmetric}

    @classmethod
    def from_json(cls, data: dict) -> QuantScheme:
        """Inverse of :meth:`to_json`; validates like the constructor."""
        if not isinstance(data, dict) or set(data) != {"kind", "group_size", "symmetric"}:
            raise ValueError(f"quantization scheme {data!r} must be a dict with kind, group_size, symmetric.")
        return cls(**data)


def check_weight_shape(shape: tuple[int, ...], scheme: QuantScheme, *, name: str = "weight") -> None:
    """Refuse a weight shape the scheme cannot hold, naming it and the fix.

    Raises:
        ValueError: not 2-D, or K not divisible by the int4 group size (or by 4 for fp6).
    """
    if len(shape) != 2 or shape[0] < 1 or shape[1] < 1:
        raise ValueError(f"{name}: shape {tuple(shape)} is not a 2-D [out_features, in_features] weight.")
    k = shape[1]
    if scheme.kind == "int4" and k % scheme.group_size:
        raise ValueError(
            f"{name}: in_features={k} is not divisible by group_size={scheme.group_size}; pick a group size "
            f"dividing {k} or leave this layer unquantized."
        )
    if scheme.kind == "fp6" and k % 4:
        raise ValueError(f"{name}: in_features={k} must be a multiple of 4 for fp6 (4 codes pack into 3 bytes).")


def weight_nbytes(shape: tuple[int, int], scheme: QuantScheme) -> int:
    """Bytes of codes, scales and zero points for one ``[N, K]`` weight: the formula tests check.

    Returns:
        int8 ``N K + 4 N``; int4 ``N K / 2 + 4 N K / g`` (+ ``N K / g`` asymmetric); fp6 ``3 N K / 4 + 4 N``.
    """
    n, k = shape
    if scheme.kind == "int8":
        return n * k + 4 * n
    if scheme.kind == "fp6":
        return 3 * n * k // 4 + 4 * n
    groups = n * k // scheme.group_size
    return n * k // 2 + 4 * groups + (0 if scheme.symmetric else groups)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` values in [0, 15] -> ``uint8 [N, K / 2]``, element ``2i`` in the low nibble."""
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: ``uint8 [N, K / 2]`` -> ``uint8 [N, K]``."""
    return torch.stack((packed & 15, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def pack_fp6(codes: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` 6-bit codes -> ``uint8 [N, 3 K / 4]`` (four codes a little-endian 24-bit word)."""
    c = codes.to(torch.int32).reshape(codes.shape[0], -1, 4)
    word = c[..., 0] | (c[..., 1] << 6) | (c[..., 2] << 12) | (c[..., 3] << 18)
    return torch.stack((word & 255, (word >> 8) & 255, word >> 16), -1).reshape(codes.shape[0], -1).to(torch.uint8)


def unpack_fp6(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_fp6`: ``uint8 [N, 3 K / 4]`` -> int64 codes ``[N, K]``."""
    b = packed.to(torch.int64).reshape(packed.shape[0], -1, 3)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    return torch.stack([(word >> (6 * j)) & 63 for j in range(4)], -1).reshape(packed.shape[0], -1)


def _fp6_encode(y: torch.Tensor) -> torch.Tensor:
    """Nearest e3m2 code of each value of ``y`` (already scaled into [-28, 28]); ties to the even code."""
    mags = FP6_VALUES[:32].to(y.device)  # increasing with the code
    mid = (mags[1:] + mags[:-1]) / 2
    a = y.abs()
    idx = torch.bucketize(a, mid)  # a == mid goes to the lower index
    tie = (idx < 31) & (a == mid[idx.clamp(max=30)])
    idx = torch.where(tie & (idx % 2 == 1), idx + 1, idx)
    return idx | torch.where(y < 0, 32, 0)


def quantize_weight(
    weight: torch.Tensor, scheme: QuantScheme
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Round-to-nearest quantization of one Linear weight.

    Args:
        weight: ``[N, K]`` fp32/bf16/fp16 weight, finite.
        scheme: the format (see the module docstring).

    Returns:
        ``(codes, scales, zeros)``; ``zeros`` is None except for asymmetric int4.

    Raises:
        ValueError: wrong shape/dtype for the scheme, or a non-finite weight (named).
    """
    if weight.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"quantize_weight: weight.dtype={weight.dtype} is not supported; cast to fp32/bf16/fp16.")
    check_weight_shape(tuple(weight.shape), scheme)
    w = weight.detach().to(torch.float32)
    if not torch.isfinite(w).all():
        raise ValueError("quantize_weight: the weight holds inf or NaN; fix the checkpoint before quantizing.")
    n, k = w.shape
    if scheme.kind == "int8":
        scale = w.abs().amax(dim=1, keepdim=True) / 127
        codes = torch.where(scale > 0, w / scale, 0.0).round().clamp(-127, 127).to(torch.int8)
        return codes, scale, None
    if scheme.kind == "fp6":
        scale = w.abs().amax(dim=1, keepdim=True) / FP6_MAX
        codes = _fp6_encode(torch.where(scale > 0, w / scale, 0.0))
        return pack_fp6(codes), scale, None
    g = w.reshape(n, k // scheme.group_size, scheme.group_size)
    if scheme.symmetric:
        scale = g.abs().amax(dim=2) / 7
        zero = torch.full_like(scale, 8.0)
    else:
        lo, hi = g.amin(dim=2).clamp(max=0), g.amax(dim=2).clamp(min=0)
        scale = (hi - lo) / 15
        zero = torch.where(scale > 0, (-lo / scale).round(), 8.0).clamp(0, 15)
    y = torch.where(scale[..., None] > 0, g / scale[..., None], 0.0)
    q = (y.round() + zero[..., None]).clamp(0, 15).reshape(n, k)
    return pack_int4(q), scale, None if scheme.symmetric else zero.to(torch.uint8)


def dequantize_weight(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, scheme: QuantScheme,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The ``[N, K]`` weight the codes stand for (computed in fp32, cast to ``dtype``).

    Args:
        codes, scales, zeros: as :func:`quantize_weight` returns them.
        scheme: their format.
        dtype: the result's dtype.

    Returns:
        The dequantized weight.
    """
    if scheme.kind == "int8":
        return (codes.to(torch.float32) * scales).to(dtype)
    if scheme.kind == "fp6":
        values = FP6_VALUES.to(codes.device)[unpack_fp6(codes)]
        return (values * scales).to(dtype)
    # q - z in small integers (exact), then one multiply that promotes to fp32: the same values as
    # subtracting in fp32, with two fewer fp32 passes over the weight (prefill dequantizes per step).
    q = unpack_int4(codes)
    n, k = q.shape
    q = q.reshape(n, -1, scheme.group_size)
    if zeros is None:
        centred = q.view(torch.int8).sub_(8)
    else:
        centred = q.to(torch.int16).sub_(zeros.to(torch.int16)[..., None])
    return torch.mul(centred, scales[..., None]).reshape(n, k).to(dtype)


def quant_matmul_reference(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    scheme: QuantScheme, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Pure-torch ``x @ dequantize(W)^T + bias`` in fp32, cast to ``x.dtype``: the test oracle.

    Args:
        x: ``[..., K]`` input.
        codes, scales, zeros, scheme: the quantized weight.
        bias: optional ``[N]``.

    Returns:
        ``[..., N]`` in x's dtype.
    """
    w = dequantize_weight(codes, scales, zeros, scheme)
    y = x.to(torch.float32) @ w.T
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype)


def _validate(x, codes, scales, zeros, scheme, bias) -> None:
    """Refuse bad inputs before any launch, naming the argument and the fix."""
    if not isinstance(scheme, QuantScheme):
        raise TypeError(f"quant_matmul: scheme must be a QuantScheme, got {type(scheme).__name__}.")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"quant_matmul: x.dtype={x.dtype} is not supported; cast x to fp32, bf16 or fp16.")
    n = codes.shape[0] if codes.dim() == 2 else -1
    k = x.shape[-1] if x.dim() >= 1 else -1
    per_row = {"int8": k, "int4": k // 2, "fp6": 3 * k // 4}[scheme.kind]
    want_codes = torch.int8 if scheme.kind == "int8" else torch.uint8
    if codes.dim() != 2 or codes.dtype != want_codes or codes.shape[1] != per_row:
        raise ValueError(
            f"quant_matmul: codes {tuple(codes.shape)} {codes.dtype} do not fit x.shape[-1]={k} for "
            f"{scheme.kind}; expected {want_codes} [N, {per_row}] from quantize_weight."
        )
    check_weight_shape((n, k), scheme, name="quant_matmul weight")
    groups = 1 if scheme.group_size is None else k // scheme.group_size
    if scales.dtype != torch.float32 or tuple(scales.shape) != (n, groups):
        raise ValueError(f"quant_matmul: scales {tuple(scales.shape)} {scales.dtype} must be float32 [{n}, {groups}].")
    if (zeros is None) != (scheme.kind != "int4" or scheme.symmetric):
        raise ValueError("quant_matmul: zeros must be given exactly for asymmetric int4.")
    if zeros is not None and (zeros.dtype != torch.uint8 or tuple(zeros.shape) != (n, groups)):
        raise ValueError(f"quant_matmul: zeros {tuple(zeros.shape)} {zeros.dtype} must be uint8 [{n}, {groups}].")
    if bias is not None and tuple(bias.shape) != (n,):
        raise ValueError(f"quant_matmul: bias.shape={tuple(bias.shape)} must be ({n},).")
    for name, t in (("codes", codes), ("scales", scales), ("zeros", zeros), ("bias", bias)):
        if t is not None and t.device != x.device:
            raise ValueError(f"quant_matmul: {name} is on {t.device} but x is on {x.device}; move it to {x.device}.")


def check_inputs(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    scheme: QuantScheme, bias: torch.Tensor | None = None,
) -> None:
    """The checks :func:`quant_matmul` runs, for callers that hold codes from elsewhere (a checkpoint).

    Raises:
        TypeError: scheme is not a QuantScheme.
        ValueError: dtype, shape or device of any argument does not fit (named, with the fix).
    """
    _validate(x, codes, scales, zeros, scheme, bias)


@torch.library.custom_op("plait::quant_matmul", mutates_args=())
def _quant_matmul_op(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    kind: str, group_size: int, symmetric: bool, bias: torch.Tensor | None,
) -> torch.Tensor:
    scheme = QuantScheme(kind=kind, group_size=group_size or None, symmetric=symmetric)
    if dispatch.select_backend(x, codes) == dispatch.TRITON:
        from plait.kernels.ops.quant_matmul_triton import quant_matmul_triton

        return quant_matmul_triton(x, codes, scales, zeros, kind, group_size, bias)
    return quant_matmul_reference(x, codes, scales, zeros, scheme, bias)


@_quant_matmul_op.register_fake
def _quant_matmul_fake(x, codes, scales, zeros, kind, group_size, symmetric, bias):
    # Shapes only, so torch.compile / export trace a model holding quantized Linears.
    return x.new_empty((*x.shape[:-1], codes.shape[0]))


def quant_matmul(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    scheme: QuantScheme, bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x @ dequantize(W)^T + bias`` without materialising W on the Triton path.

    Runs the Triton kernel on CUDA and :func:`quant_matmul_reference` elsewhere
    (``PLAIT_KERNEL_BACKEND`` forces one); goes through the ``plait::quant_matmul`` custom op,
    whose fake implementation lets ``torch.compile`` trace it. No autograd (inference only).

    Args:
        x: ``[..., K]`` fp32/bf16/fp16 input.
        codes, scales, zeros: the weight as :func:`quantize_weight` returns it.
        scheme: its format.
        bias: optional ``[N]``.

    Returns:
        ``[..., N]`` in x's dtype.

    Raises:
        TypeError: scheme is not a QuantScheme.
        ValueError: dtype, shape or device of any argument does not fit (named, with the fix).
    """
    _validate(x, codes, scales, zeros, scheme, bias)
    return _quant_matmul_op(x, codes, scales, zeros, scheme.kind, scheme.group_size or 0, scheme.symmetric, bias)


def dense_matmul_cpu(
    x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
    scheme: QuantScheme, *, rows: int = DENSE_CHUNK_ROWS, own_kernel: bool = False,
) -> torch.Tensor:
    """CPU path for many input rows (prefill): dequantize ``rows`` weight rows at a time, fp32 GEMM each.

    torch's weight-packed kernels are built for a few rows; with many rows one fp32 GEMM wins, and
    dequantizing the weight block by block keeps each fp32 block in cache for the GEMM that reads
    it (no ``[N, K]`` fp32 weight is ever materialised). Each block's values are exactly
    :func:`dequantize_weight`'s, so the result equals :func:`quant_matmul_reference` up to the
    GEMM's summation order.

    Args:
        x: ``[..., K]`` CPU input (any float dtype; computed in fp32, returned in x's dtype).
        codes, scales, zeros, scheme: the weight as :func:`quantize_weight` returns it.
        rows: weight rows per block.
        own_kernel: dequantize each block with plait's CPU extension
            (:func:`plait.kernels.ops.quant_matmul_cpu.dequantize_rows`, int8/int4, one vectorized
            pass into a reused buffer, the same values) instead of torch ops (several passes).

    Returns:
        ``[..., N]`` in x's dtype (no bias: the caller adds it).
    """
    x2 = x.reshape(-1, x.shape[-1]).to(torch.float32)
    n = codes.shape[0]
    out_t = x2.new_empty(n, x2.shape[0])  # y^T, so each block writes contiguous rows
    buffer = x2.new_empty(min(rows, n), x2.shape[1]) if own_kernel else None
    for start in range(0, n, rows):
        end = min(n, start + rows)
        if buffer is not None:
            block = quant_matmul_cpu.dequantize_rows(codes, scales, zeros, scheme.group_size, start, end,
                                                     buffer[: end - start])
        else:
            block = dequantize_weight(codes[start:end], scales[start:end],
                                      None if zeros is None else zeros[start:end], scheme)
        torch.mm(block, x2.T, out=out_t[start:end])
    # One copy of the (small) output back to row-major: HF's attention views q/k/v outputs.
    return out_t.T.contiguous().reshape(*x.shape[:-1], n).to(x.dtype)


def int8_matmul_cpu(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """CPU int8 path: torch's ``_weight_int8pack_mm`` (scales rounded to x's dtype, as it requires).

    Args:
        x: ``[..., K]`` CPU input; codes ``int8 [N, K]``; scales ``float32 [N, 1]``.

    Returns:
        ``[..., N]`` in x's dtype (no bias: the caller adds it).
    """
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch._weight_int8pack_mm(x2, codes, scales.reshape(-1).to(x.dtype))
    return y.reshape(*x.shape[:-1], codes.shape[0])


def int4_cpu_packable(shape: tuple[int, int]) -> bool:
    """Whether torch's CPU int4 kernel takes a ``[N, K]`` weight (its packing needs N % 16 == 0)."""
    return shape[0] % 16 == 0 and shape[1] % 2 == 0


def prepack_int4_cpu(
    codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, scheme: QuantScheme,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Re-lay an int4 weight for ``torch._weight_int4pack_mm_for_cpu``.

    That kernel computes ``w = (q - 8) * scale + zero`` with a float ``zero``, so a zero point
    ``z`` becomes ``zero = (8 - z) * scale`` (0 for symmetric).

    Returns:
        ``(packed, scales_and_zeros)``: torch's blocked ``uint8 [N, K / 2]`` layout and
        ``[K / group_size, N, 2]`` in ``dtype`` (the activations' dtype).
    """
    q = unpack_int4(codes).to(torch.int32)
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    z = torch.zeros_like(scales) if zeros is None else (8.0 - zeros.to(torch.float32)) * scales
    return packed, torch.stack((scales.T, z.T), dim=-1).to(dtype).contiguous()


def int4_matmul_cpu(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    """CPU int4 path: torch's ``_weight_int4pack_mm_for_cpu`` on a :func:`prepack_int4_cpu` weight."""
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch._weight_int4pack_mm_for_cpu(x2, packed, group_size, scales_and_zeros)
    return y.reshape(*x.shape[:-1], packed.shape[0])
