"""``QuantizedLinear`` and ``QuantizedEmbedding``: modules that hold weight-only quantized codes.

Both keep the codes, scales and (asymmetric int4) zero points as persistent buffers, so
``state_dict()`` holds the quantized weight and nothing else of it. ``QuantizedLinear`` runs
``y = x @ dequantize(W)^T + b``:

* on CPU with at least ``CPU_DENSE_ROWS`` (32) rows of input (prefill), through
  :func:`plait.kernels.ops.quant_matmul.dense_matmul_cpu`: the weight is dequantized to fp32 128
  rows at a time, each block multiplied while it is still in cache (no full fp32 weight is built);
* on CPU with fewer rows (decode), through the matmuls torch ships for this (``torch._weight_int8pack_mm`` for int8,
  ``torch._weight_int4pack_mm_for_cpu`` for int4 when ``out_features % 16 == 0``), which read the
  codes directly; the int4 one needs torch's own blocked layout, built once per activation dtype
  and cached on the module (another ``N K / 2`` bytes plus the scales, freed by
  :meth:`QuantizedLinear.drop_cpu_cache`);
* with ``cpu_kernel="plait"``, on CPU for int8/int4 weights whose in_features is a multiple of 16:
  plait's own AVX2 kernels (:mod:`plait.kernels.ops.quant_matmul_cpu`, a C++ extension built on
  first use) instead of torch's: a GEMV that decodes the codes in registers for decode (fp32
  activations, no bf16 rounding), and a one-pass block dequantize for prefill;
* everywhere else (CUDA, fp6, shapes torch's kernels refuse), through
  :func:`plait.kernels.ops.quant_matmul.quant_matmul`: the Triton kernel on CUDA, the torch
  reference (dequantize, then matmul) on CPU.
"""

from __future__ import annotations

import torch
from torch import nn

from plait.kernels.ops import quant_matmul_cpu
from plait.kernels.ops.quant_matmul import (
    QuantScheme,
    check_inputs,
    dense_matmul_cpu,
    dequantize_weight,
    int4_cpu_packable,
    int4_matmul_cpu,
    int8_matmul_cpu,
    prepack_int4_cpu,
    quant_matmul,
    quantize_weight,
)

_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# From this many rows of x on, the CPU path dequantizes the weight block by block and runs fp32
# GEMMs. On the benchmark's 2048 x 768 Linears torch's bf16 int8/int4 kernels were ~1.5x faster
# than an fp32 GEMM at 1 and 8 rows and ~2x slower at 128; the blocked dense path was ~1.15x the
# fp32 GEMM at 32 rows.
CPU_DENSE_ROWS = 32
CPU_KERNELS = ("torch", "plait")


def check_cpu_kernel(cpu_kernel: str, *, field: str = "cpu_kernel") -> None:
    """Refuse an unknown CPU kernel choice, or ``"plait"`` where its extension cannot be had.

    ``"plait"`` builds the extension here on first use (a C++ compiler is needed; the
    build is cached for later processes), so the build, or its failure, happens before any weight
    is quantized.

    Raises:
        ValueError: names ``field``, the reason and the fix.
    """
    if cpu_kernel not in CPU_KERNELS:
        raise ValueError(f"{field}={cpu_kernel!r} is not supported; use one of {', '.join(CPU_KERNELS)}.")
    if cpu_kernel == "plait" and not quant_matmul_cpu.available():
        raise ValueError(f"{field}='plait' cannot be used here: {quant_matmul_cpu.build_error}; "
                         "use cpu_kernel='torch' (torch's weight-packed kernels).")


class _QuantizedWeight(nn.Module):
    """Shared storage of one quantized ``[N, K]`` weight (codes, scales, zeros) and its scheme."""

    def __init__(self, weight: torch.Tensor, scheme: QuantScheme) -> None:
        super().__init__()
        self._store(*quantize_weight(weight, scheme), scheme, tuple(weight.shape), weight.dtype, weight.device)

    def _store(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, scheme: QuantScheme,
               shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> None:
        self.scheme = scheme
        self.weight_shape = shape
        self.dtype = dtype
        self.register_buffer("weight_codes", codes.to(device))
        self.register_buffer("weight_scales", scales.to(device))
        self.register_buffer("weight_zeros", None if zeros is None else zeros.to(device))

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The ``[N, K]`` weight the codes stand for, in ``dtype`` (default: the original weight's)."""
        return dequantize_weight(self.weight_codes, self.weight_scales, self.weight_zeros, self.scheme,
                                 dtype or self.dtype)

    def extra_repr(self) -> str:
        scheme = self.scheme
        group = f", group_size={scheme.group_size}, symmetric={scheme.symmetric}" if scheme.kind == "int4" else ""
        return f"shape={self.weight_shape}, kind={scheme.kind}{group}"


class QuantizedLinear(_QuantizedWeight):
    """A Linear whose weight is stored quantized (inference only: no gradients).

    Args:
        linear: the ``nn.Linear`` to quantize (its weight is read, not kept).
        scheme: the format.
        cpu_kernels: on CPU, use torch's int8/int4 weight-packed matmuls where they apply (True,
            the fast path) or always the op's torch reference (False: the oracle).
        bf16_decode: on CPU, feed fp32 inputs of fewer than ``CPU_DENSE_ROWS`` rows to torch's
            kernels rounded to bf16 (the output is cast back to fp32): their fp32 path was about
            10x slower than their bf16 one in the benchmark. Off by default (it rounds activations).
            Not used by plait's kernels (they take fp32 activations as they are).
        cpu_kernel: with ``cpu_kernels``, whose CPU kernels run int8/int4: ``"torch"`` (torch's
            weight-packed matmuls, nothing to build) or ``"plait"`` (plait's AVX2 extension; see
            :func:`check_cpu_kernel`). fp6 and weights whose in_features is not a multiple of 16
            use the torch paths either way.

    Raises:
        ValueError: the weight's shape or dtype does not fit the scheme, or it holds inf/NaN;
            ``cpu_kernel`` unknown or not available here.
    """

    def __init__(self, linear: nn.Linear, scheme: QuantScheme, *, cpu_kernels: bool = True,
                 bf16_decode: bool = False, cpu_kernel: str = "torch") -> None:
        check_cpu_kernel(cpu_kernel)
        super().__init__(linear.weight.detach(), scheme)
        self._linear(linear.bias, cpu_kernels, bf16_decode, cpu_kernel)

    def _linear(self, bias: torch.Tensor | None, cpu_kernels: bool, bf16_decode: bool, cpu_kernel: str) -> None:
        self.out_features, self.in_features = self.weight_shape
        self.cpu_kernels = cpu_kernels
        self.bf16_decode = bf16_decode
        self.cpu_kernel = cpu_kernel
        # plait's kernels take this weight: int8/int4 with K a multiple of their 16-element step.
        self._own = (cpu_kernel == "plait" and self.scheme.kind in ("int8", "int4")
                     and quant_matmul_cpu.fits(self.in_features))
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self._cpu_int4: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
        self._cpu_int8_scales: dict[torch.dtype, torch.Tensor] = {}

    @classmethod
    def from_codes(cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, scheme: QuantScheme,
                   *, in_features: int, dtype: torch.dtype, bias: torch.Tensor | None = None,
                   cpu_kernels: bool = True, bf16_decode: bool = False, cpu_kernel: str = "torch") -> QuantizedLinear:
        """A QuantizedLinear holding already quantized codes (a checkpoint's, a serving engine's).

        Args:
            codes, scales, zeros: as :func:`plait.kernels.ops.quant_matmul.quantize_weight` returns them.
            scheme: their format.
            in_features: K.
            dtype: the dtype of the weight they stand for.
            bias, cpu_kernels, bf16_decode, cpu_kernel: as the constructor.

        Raises:
            ValueError: codes, scales or zeros that do not fit ``[codes.shape[0], in_features]``
                in the scheme (named); ``cpu_kernel`` unknown or not available.
        """
        check_cpu_kernel(cpu_kernel)
        shape = (codes.shape[0], in_features)
        check_inputs(torch.empty(1, in_features, device=codes.device), codes, scales, zeros, scheme, bias)
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._store(codes, scales, zeros, scheme, shape, dtype, codes.device)
        module._linear(bias, cpu_kernels, bf16_decode, cpu_kernel)
        return module

    @classmethod
    def from_weight(cls, weight: torch.Tensor, scheme: QuantScheme, *, bias: torch.Tensor | None = None,
                    cpu_kernels: bool = True, bf16_decode: bool = False, cpu_kernel: str = "torch") -> QuantizedLinear:
        """A QuantizedLinear for a bare ``[N, K]`` weight (one expert of a fused 3-D expert tensor).

        Args:
            weight: ``[N, K]`` fp32/bf16/fp16 weight, finite (read, not kept).
            scheme, bias, cpu_kernels, bf16_decode, cpu_kernel: as the constructor.

        Raises:
            ValueError: the weight's shape or dtype does not fit the scheme, or it holds inf/NaN.
        """
        codes, scales, zeros = quantize_weight(weight.detach(), scheme)
        return cls.from_codes(codes, scales, zeros, scheme, in_features=weight.shape[1], dtype=weight.dtype,
                              bias=bias, cpu_kernels=cpu_kernels, bf16_decode=bf16_decode, cpu_kernel=cpu_kernel)

    def drop_cpu_cache(self) -> None:
        """Free the int4 weight re-laid out for torch's CPU kernel and the int8 scales cast for it
        (rebuilt on the next CPU forward)."""
        self._cpu_int4.clear()
        self._cpu_int8_scales.clear()

    def _cpu_path(self, x: torch.Tensor) -> torch.Tensor | None:
        if not (self.cpu_kernels and x.device.type == "cpu" and x.dtype in _CPU_DTYPES):
            return None
        if x.numel() // max(1, x.shape[-1]) >= CPU_DENSE_ROWS:
            # Prefill: torch's weight-packed kernels are built for few rows and lose to fp32 GEMMs
            # on the weight dequantized block by block (one pass over the codes, cache-resident).
            return dense_matmul_cpu(x, self.weight_codes, self.weight_scales, self.weight_zeros, self.scheme,
                                    own_kernel=self._own)
        if self._own:
            # Decode: the codes decoded in registers, fp32 activations as they are.
            y = quant_matmul_cpu.gemv(x.to(torch.float32), self.weight_codes, self.weight_scales, self.weight_zeros,
                                      self.scheme.group_size)
            return y.to(x.dtype)
        if self.bf16_decode and x.dtype == torch.float32:
            y = self._packed(x.to(torch.bfloat16))
            return None if y is None else y.to(torch.float32)
        return self._packed(x)

    def _packed(self, x: torch.Tensor) -> torch.Tensor | None:
        if self.scheme.kind == "int8":
            # torch's kernel wants the scales in x's dtype: cast once, not every step.
            scales = self._cpu_int8_scales.get(x.dtype)
            if scales is None:
                scales = self._cpu_int8_scales.setdefault(x.dtype, self.weight_scales.to(x.dtype))
            return int8_matmul_cpu(x, self.weight_codes, scales)
        if self.scheme.kind == "int4" and int4_cpu_packable(self.weight_shape):
            packed = self._cpu_int4.get(x.dtype)
            if packed is None:
                packed = prepack_int4_cpu(self.weight_codes, self.weight_scales, self.weight_zeros, self.scheme,
                                          x.dtype)
                self._cpu_int4[x.dtype] = packed
            return int4_matmul_cpu(x, packed[0], packed[1], self.scheme.group_size)
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ dequantize(W)^T + b`` in x's dtype.

        Args:
            x: ``[..., in_features]`` fp32/bf16/fp16 input.

        Returns:
            ``[..., out_features]``.
        """
        y = self._cpu_path(x)
        if y is None:
            return quant_matmul(x, self.weight_codes, self.weight_scales, self.weight_zeros, self.scheme,
                                None if self.bias is None else self.bias.to(torch.float32))
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def to_linear(self) -> nn.Linear:
        """A plain ``nn.Linear`` holding the dequantized weight (in the original dtype)."""
        w = self.dequantized_weight()
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None,
                           device=w.device, dtype=w.dtype)
        with torch.no_grad():
            linear.weight.copy_(w)
            if self.bias is not None:
                linear.bias.copy_(self.bias)
        return linear


class QuantizedEmbedding(_QuantizedWeight):
    """An embedding table stored quantized: each looked-up row is dequantized on the fly.

    Args:
        embedding: the ``nn.Embedding`` to quantize (rows are quantized like Linear rows: per row
            for int8/fp6, in groups along the embedding dimension for int4).
        scheme: the format.

    Raises:
        ValueError: the table's shape or dtype does not fit the scheme, or it holds inf/NaN.
    """

    def __init__(self, embedding: nn.Embedding, scheme: QuantScheme) -> None:
        super().__init__(embedding.weight.detach(), scheme)
        self.num_embeddings, self.embedding_dim = embedding.num_embeddings, embedding.embedding_dim
        self.padding_idx = embedding.padding_idx

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of the dequantized table, in the original dtype.

        Args:
            ids: integer tensor of any shape.

        Returns:
            ``[*ids.shape, embedding_dim]``.
        """
        flat = ids.reshape(-1)
        zeros = None if self.weight_zeros is None else self.weight_zeros[flat]
        rows = dequantize_weight(self.weight_codes[flat], self.weight_scales[flat], zeros, self.scheme, self.dtype)
        return rows.reshape(*ids.shape, self.embedding_dim)

    def to_embedding(self) -> nn.Embedding:
        """A plain ``nn.Embedding`` holding the dequantized table."""
        w = self.dequantized_weight()
        return nn.Embedding(self.num_embeddings, self.embedding_dim, padding_idx=self.padding_idx,
                            _weight=w.clone(), _freeze=True, device=w.device, dtype=w.dtype)
