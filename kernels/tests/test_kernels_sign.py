"""The Triton sign kernels against the torch reference, bit for bit.

``pack_signs``, ``unpack_bits``, ``unpack_signs`` and ``compress_with_error_feedback`` on their Triton
path (CUDA when this machine has a GPU, else the Triton CPU interpreter: ``TRITON_INTERPRET=1`` with
``PLAIT_KERNEL_BACKEND=triton``) must give the reference's bytes, bits, scale and error exactly:
odd sizes, sizes that are not a multiple of 8 (the padded last byte), sizes spanning several
programs, every floating dtype, zeros of both signs, NaN and infinities, strided inputs. And every
kernel compiles for CUDA (sm_80, sm_90) without a GPU, so what the interpreter checks is what a GPU
would run.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from plait.kernels import dispatch
from plait.kernels.ops import compress_with_error_feedback, pack_signs, packed_numel, unpack_bits, unpack_signs
from plait.kernels.ops.sign import unpack_scaled_signs

# 4096 elements is one Triton program (sign_triton.BYTES = 512 bytes): sizes on both sides of it.
SIZES = (1, 3, 7, 8, 9, 31, 64, 257, 4095, 4096, 4097, 9001)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _reference(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn`` on the torch path (the backend forced to the reference for this call only)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PLAIT_KERNEL_BACKEND", "reference")
        return fn(*args)


def _data(numel: int, *, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    x[::5] = 0.0  # zero counts as positive
    x[1::7] = -0.0  # so does negative zero
    return x.to(dtype)


def _same_float_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bit for bit, the sign of zero included (NaNs compared by position)."""
    assert got.dtype == want.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(got.nan_to_num(0.0).view(torch.int32), want.nan_to_num(0.0).view(torch.int32))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("numel", SIZES)
def test_pack_and_unpack_match_the_reference_bitwise(triton_backend, numel, dtype):
    x = _data(numel, seed=numel, dtype=dtype).to(triton_backend)
    packed = pack_signs(x)
    want = _reference(pack_signs, x.cpu())
    assert packed.device.type == triton_backend and torch.equal(packed.cpu(), want)
    assert packed.numel() == packed_numel(numel)
    bits = unpack_bits(packed, numel)
    assert bits.dtype == torch.bool and torch.equal(bits.cpu(), _reference(unpack_bits, want, numel))
    signs = unpack_signs(packed, numel)
    assert signs.dtype == torch.float32 and torch.equal(signs.cpu(), _reference(unpack_signs, want, numel))


def test_padding_bits_and_special_values(triton_backend):
    x = torch.tensor([math.nan, math.inf, -math.inf, -0.0, 0.0, -1e-45, 1e-45, -2.0, 3.0, math.nan, -5.0])
    packed = pack_signs(x.to(triton_backend)).cpu()
    # byte 0: NaN 0, inf 1, -inf 0, -0.0 1, 0.0 1, -tiny 0, tiny 1, -2 0; byte 1: 3 1, NaN 0, -5 0, then
    # five padding bits of 1.
    assert packed.tolist() == [0b0101_1010, 0b1111_1001]
    assert torch.equal(packed, _reference(pack_signs, x))
    # Unpacking fewer elements than the bytes hold reads only those: a prefix of the signs.
    assert torch.equal(unpack_signs(packed.to(triton_backend), 5).cpu(), torch.tensor([-1.0, 1, -1, 1, 1]))


@pytest.mark.parametrize("numel", (1, 9, 4097))
def test_unpack_scaled_signs_matches_the_reference_bitwise(triton_backend, numel):
    packed = pack_signs(_data(numel, seed=numel + 7).to(triton_backend))
    scale = torch.tensor(0.37, device=triton_backend)
    want = _reference(unpack_scaled_signs, packed.cpu(), numel, scale.cpu())
    _same_float_bits(unpack_scaled_signs(packed, numel, scale).cpu(), want)
    buffer = torch.full((2 * numel,), 7.0, device=triton_backend)
    for out in (buffer[:numel], buffer[::2]):  # into a slice, and a strided one
        assert unpack_scaled_signs(packed, numel, scale, out=out) is out
        _same_float_bits(out.cpu(), want)
    assert bool((buffer[1::2][numel // 2 + 1:] == 7.0).all())  # nothing written past out


def test_strided_and_multidimensional_inputs_are_read_flat(triton_backend):
    grid = _data(33 * 20, seed=5).view(33, 20).to(triton_backend)
    for x in (grid.t(), grid[:, ::3], grid.to(torch.bfloat16)[::2]):
        assert torch.equal(pack_signs(x).cpu(), _reference(pack_signs, x.cpu()))
    packed = pack_signs(grid).cpu()[:80].view(10, 8)[:, ::2]  # strided bytes
    assert torch.equal(unpack_signs(packed.to(triton_backend), 8 * packed.numel()).cpu(),
                       _reference(unpack_signs, packed, 8 * packed.numel()))


@pytest.mark.parametrize("numel", SIZES)
def test_compress_with_error_feedback_matches_the_reference_bitwise(triton_backend, numel):
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    error = torch.randn(numel, generator=torch.Generator().manual_seed(numel + 1)) * 0.1
    ref_error = error.clone()
    error = error.to(triton_backend)
    packed, scale = compress_with_error_feedback(x.to(triton_backend), error)
    ref_packed, ref_scale = _reference(compress_with_error_feedback, x, ref_error)
    assert torch.equal(packed.cpu(), ref_packed)
    _same_float_bits(scale.cpu(), ref_scale)
    _same_float_bits(error.cpu(), ref_error)  # updated in place to c - scale * sign(c), the same bits
    # A second call carries the error on, as the optimizers do every step.
    again = compress_with_error_feedback(x.to(triton_backend), error)
    ref_again = _reference(compress_with_error_feedback, x, ref_error)
    assert torch.equal(again[0].cpu(), ref_again[0])
    _same_float_bits(error.cpu(), ref_error)


def test_compress_special_values_and_a_strided_error(triton_backend):
    x = _data(1001, seed=3)
    x[10], x[500] = math.nan, math.inf
    error = torch.zeros(2002, device=triton_backend)[::2]  # a strided view: updated in place all the same
    ref_error = torch.zeros(1001)
    packed, scale = compress_with_error_feedback(x.to(triton_backend), error)
    ref_packed, ref_scale = _reference(compress_with_error_feedback, x, ref_error)
    assert torch.equal(packed.cpu(), ref_packed)
    _same_float_bits(scale.cpu(), ref_scale)  # NaN: the corruption stays visible, on both paths
    _same_float_bits(error.cpu(), ref_error)
    zeros = torch.zeros(13, device=triton_backend)
    packed, scale = compress_with_error_feedback(torch.zeros(13, device=triton_backend), zeros)
    assert packed.cpu().tolist() == [255, 255] and float(scale) == 0.0 and not bool(zeros.any())


def test_empty_inputs_and_refusals_on_the_triton_path(triton_backend):
    assert pack_signs(torch.empty(0, device=triton_backend)).numel() == 0
    assert unpack_signs(torch.empty(0, dtype=torch.uint8, device=triton_backend), 0).numel() == 0
    packed, scale = compress_with_error_feedback(torch.empty(0, device=triton_backend),
                                                 torch.empty(0, device=triton_backend))
    assert packed.numel() == 0 and float(scale) == 0.0
    with pytest.raises(TypeError, match="floating-point"):
        pack_signs(torch.arange(4, device=triton_backend))
    with pytest.raises(ValueError, match="numel=17"):
        unpack_signs(torch.zeros(2, dtype=torch.uint8, device=triton_backend), 17)
    with pytest.raises(TypeError, match="uint8"):
        unpack_bits(torch.zeros(2, device=triton_backend), 3)


def test_cpu_tensors_take_the_reference_by_default(monkeypatch):
    monkeypatch.delenv("PLAIT_KERNEL_BACKEND", raising=False)
    assert dispatch.select_backend(torch.zeros(3)) == dispatch.REFERENCE
    x = _data(100, seed=9)
    assert torch.equal(unpack_signs(pack_signs(x), 100), torch.where(x >= 0, 1.0, -1.0))


# Compiles every kernel for CUDA targets without a GPU (triton's bundled LLVM and ptxas), in a
# process without the interpreter: what the interpreter runs is then what a GPU gets to run.
_COMPILE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from plait.kernels.ops import sign_triton as S

cases = [
    (S._pack_kernel, {"X": "*fp32", "OUT": "*u8", "N": "i64", "NBYTES": "i64"}, {"WIDEN": False}),
    (S._pack_kernel, {"X": "*bf16", "OUT": "*u8", "N": "i32", "NBYTES": "i32"}, {"WIDEN": True}),
    (S._pack_kernel, {"X": "*fp64", "OUT": "*u8", "N": "i32", "NBYTES": "i32"}, {"WIDEN": False}),
    (S._unpack_kernel, {"P": "*u8", "SCALE": "*u8", "OUT": "*fp32", "N": "i32", "NBYTES": "i32"},
     {"AS_SIGNS": True, "HAS_SCALE": False}),
    (S._unpack_kernel, {"P": "*u8", "SCALE": "*fp32", "OUT": "*fp32", "N": "i32", "NBYTES": "i32"},
     {"AS_SIGNS": True, "HAS_SCALE": True}),
    (S._unpack_kernel, {"P": "*u8", "SCALE": "*u8", "OUT": "*u8", "N": "i32", "NBYTES": "i32"},
     {"AS_SIGNS": False, "HAS_SCALE": False}),
    (S._sign_error_kernel, {"C": "*fp32", "SCALE": "*fp32", "OUT": "*u8", "N": "i32", "NBYTES": "i32"}, {}),
]
out = []
for arch in (80, 90):
    for fn, signature, constants in cases:
        constants = {**constants, "BYTES": S.BYTES}
        source = ASTSource(fn=fn, signature={**signature, **{k: "constexpr" for k in constants}},
                           constexprs=constants)
        kernel = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})
        out.append([arch, fn.__name__, len(kernel.asm["cubin"]), "fma." in kernel.asm["ptx"]])
print(json.dumps(out))
"""


@pytest.mark.timeout(300)
def test_kernels_compile_for_cuda_without_a_gpu():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PLAIT_KERNEL_BACKEND")}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the default today, stated (silences triton's warning)
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=280)
    if done.returncode and "ptxas" in done.stderr and "not found" in done.stderr:
        pytest.skip("this triton install has no bundled ptxas")
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(compiled) == 14 and all(size > 0 for _, _, size, _ in compiled)
    # The fused pass adds or subtracts the scale: no multiply-add for the compiler to contract.
    assert not any(fma for _, name, _, fma in compiled if name == "_sign_error_kernel")
