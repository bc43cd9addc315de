"""plait's own CPU kernels for weight-only int8/int4 matmuls (AVX2 + FMA, AVX-512; compiled on first use).

torch's CPU weight-packed kernels (``_weight_int8pack_mm``, ``_weight_int4pack_mm_for_cpu``) were
compute-bound on one thread on an AVX2 CPU and about 10x slower on fp32 inputs than on bf16 ones,
so decode gained little over an fp32 GEMV. These kernels read the codes, turn them into the very
fp32 weights :func:`plait.kernels.ops.quant_matmul.dequantize_weight` gives (``(q - z) * scale``
for int4, one rounding, the same one) in registers and multiply them with fp32 activations; int8
sums ``x * code`` and multiplies the sum by the channel's scale (two fewer multiplies per 16
weights). So only the order of the roundings differs from
:func:`plait.kernels.ops.quant_matmul.quant_matmul_reference`, their test oracle. Two entry points:

* :func:`gemv` for a few rows of input (decode): each weight row is decoded once and used for
  every input row (register tiles of up to 4 input rows by 2 or 4 weight rows; with AVX-512, up to
  8 input rows), split over weight rows across ``torch.get_num_threads()`` OpenMP threads. Where
  the CPU has AVX-512 (F/BW/VL/DQ, checked at run time) the GEMV runs 512-bit code compiled into
  the same library: one register per 16 weights, and int4 decoded by one permute from a per-group
  table of the 16 values ``(q - z) * scale`` (the reference's own values). On one thread of the
  benchmark's Linears (768 to 2048 features, weights rotated past L3, thread CPU time) that took
  about 2x (int4; int8 at batch 8) to 4x (int8 at batch 1) fewer CPU-seconds per call than the
  AVX2 code; :func:`isas` lists what runs here, and ``isa=`` picks one (the tests run both).
  Both GEMVs prefetch each weight row's codes 4 KiB ahead: a tile streams 2 to 4 rows at once, and
  on the benchmark model's decode steps (one thread) that took the int8 step from about 1.8x to
  about 2.6x fewer CPU-seconds than fp32's.
* :func:`dequantize_rows` for prefill: a block of weight rows decoded in one vectorized pass into
  an fp32 buffer, which :func:`plait.kernels.ops.quant_matmul.dense_matmul_cpu` hands to a GEMM.

The kernels are plain C++ with AVX2 (and, in marked functions, AVX-512) intrinsics and no torch
headers: the first use on a machine compiles them into a small shared library (``c++ -O3 -mavx2
-mfma``, a few seconds; ``CXX`` picks the compiler) under ``PLAIT_CACHE_DIR`` (default
``~/.cache/plait``), named by a hash of the source, and later processes load that file (ctypes).
:func:`available` says whether they can run here and never raises; torch's kernels stay the
fallback, and the choice is the caller's
(``QuantizeConfig.cpu_kernel``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

_SOURCE = r"""
#include <immintrin.h>
#include <algorithm>
#include <cstdint>

// 16 weights of one row from k: int4 exactly as the torch reference dequantizes them ((q - z) * scale,
// one rounding), int8 as the bare codes (times `post` gives the reference's code * scale). The scale
// and zero point of a group are set once per group by start(): no division or scalar load inside.
struct Int8Row {
  // The per-channel scale multiplies the finished dot product (post), not every weight: two fewer
  // multiplies per 16 weights in the decode loop. store_row() applies it per weight (exact values).
  const int8_t* codes; float post;
  static inline void start(int64_t) {}
  inline const char* at(int64_t k) const { return reinterpret_cast<const char*>(codes + k); }
  inline void load(int64_t k, __m256& a, __m256& b) const {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k));
    a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
    b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(raw, 8)));
  }
};

struct Int4Row {
  const uint8_t* codes; const float* scales; const uint8_t* zeros; float post; __m256 scale; __m256i zero;
  inline void start(int64_t g) {
    scale = _mm256_set1_ps(scales[g]);
    zero = _mm256_set1_epi32(zeros ? int32_t(zeros[g]) : 8);
  }
  inline const char* at(int64_t k) const { return reinterpret_cast<const char*>(codes + k / 2); }
  inline void load(int64_t k, __m256& a, __m256& b) const {
    // 8 bytes hold 16 codes, element 2i in the low nibble of byte i: interleave low and high nibbles.
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + k / 2));
    const __m128i mask = _mm_set1_epi8(0x0F);
    const __m128i q = _mm_unpacklo_epi8(_mm_and_si128(raw, mask), _mm_and_si128(_mm_srli_epi16(raw, 4), mask));
    const __m256i qa = _mm256_sub_epi32(_mm256_cvtepu8_epi32(q), zero);
    const __m256i qb = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)), zero);
    a = _mm256_mul_ps(_mm256_cvtepi32_ps(qa), scale);
    b = _mm256_mul_ps(_mm256_cvtepi32_ps(qb), scale);
  }
};

// Bytes ahead of the codes being decoded that each weight row prefetches. A GEMV streams every code
// once, and a tile reads 2 to 4 rows at once (more streams than the hardware prefetcher follows
// well): on the benchmark model's decode steps (one thread, thread CPU time) prefetching 4 KiB
// ahead cut the int8 step by about a quarter; 2 and 8 KiB did about as well, 0.5 and 1 KiB less.
constexpr int64_t kPrefetchBytes = 4096;

static inline void prefetch_ahead(const char* p) { _mm_prefetch(p + kPrefetchBytes, _MM_HINT_T0); }

static inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// out[i, j] = sum_k x[i, k] * w[j, k] for i < MT, j < NT (group: elements per scale; K for int8).
template <int MT, int NT, typename Row>
static inline void tile(const float* x, int64_t ldx, Row* rows, int64_t K, int64_t group, float* out,
                        int64_t ldo) {
  __m256 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += group, ++g) {
    for (int j = 0; j < NT; ++j) rows[j].start(g);
    for (int64_t k = g0; k < g0 + group; k += 16) {
      __m256 wa[NT], wb[NT];
      for (int j = 0; j < NT; ++j) prefetch_ahead(rows[j].at(k));
      for (int j = 0; j < NT; ++j) rows[j].load(k, wa[j], wb[j]);
      for (int i = 0; i < MT; ++i) {
        const __m256 xa = _mm256_loadu_ps(x + i * ldx + k), xb = _mm256_loadu_ps(x + i * ldx + k + 8);
        for (int j = 0; j < NT; ++j) acc[i][j] = _mm256_fmadd_ps(xb, wb[j], _mm256_fmadd_ps(xa, wa[j], acc[i][j]));
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) out[i * ldo + j] = hsum(acc[i][j]) * rows[j].post;
}

template <int NT, typename Row>
static void rows_tile(const float* x, int64_t M, int64_t K, int64_t group, Row* rows, float* out, int64_t N) {
  for (int64_t m = 0; m < M; m += 4) {
    const int64_t mt = std::min<int64_t>(4, M - m);
    const float* xm = x + m * K;
    float* om = out + m * N;
    switch (mt) {
      case 1: tile<1, NT>(xm, K, rows, K, group, om, N); break;
      case 2: tile<2, NT>(xm, K, rows, K, group, om, N); break;
      case 3: tile<3, NT>(xm, K, rows, K, group, om, N); break;
      default: tile<4, NT>(xm, K, rows, K, group, om, N); break;
    }
  }
}

template <typename MakeRow>
static void gemv_impl(const float* x, int64_t M, int64_t K, int64_t N, int64_t group, float* out, MakeRow make,
                      int threads) {
  // Few input rows: 4 weight rows a tile (more independent FMA chains); more rows: 2 (registers).
  const int64_t nt = M <= 2 ? 4 : 2;
  const int64_t blocks = (N + nt - 1) / nt;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n = b * nt;
    if (n + nt <= N) {
      decltype(make(0)) rows[4];
      for (int64_t j = 0; j < nt; ++j) rows[j] = make(n + j);
      if (nt == 4) rows_tile<4>(x, M, K, group, rows, out + n, N);
      else rows_tile<2>(x, M, K, group, rows, out + n, N);
    } else {
      for (int64_t j = n; j < N; ++j) {
        decltype(make(0)) row = make(j);
        rows_tile<1>(x, M, K, group, &row, out + j, N);
      }
    }
  }
}

template <typename Row>
static inline void store_row(Row& row, int64_t K, int64_t group, float* dst) {
  const __m256 post = _mm256_set1_ps(row.post);  // int4: 1 (exact); int8: the scale
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += group, ++g) {
    row.start(g);
    for (int64_t k = g0; k < g0 + group; k += 16) {
      __m256 a, b;
      row.load(k, a, b);
      _mm256_storeu_ps(dst + k, _mm256_mul_ps(a, post));
      _mm256_storeu_ps(dst + k + 8, _mm256_mul_ps(b, post));
    }
  }
}

// The same GEMV in 512-bit registers, for CPUs with AVX-512 (chosen at run time, see plait_qmm_isa):
// one register holds the 16 weights of a step, so each step is one load-and-widen, one convert and
// one FMA per input row. Element values are the AVX2 path's (the same roundings); only the lanes of
// the final sums differ. 32 registers hold tiles of up to 8 input rows (batch 8 decodes each weight
// row once).
// A function attribute, not a pragma, so GCC and clang both compile these for AVX-512 only.
#define PLAIT_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq")))
struct Int8Row16 {
  const int8_t* codes; float post;
  static inline void start(int64_t) {}
  inline const char* at(int64_t k) const { return reinterpret_cast<const char*>(codes + k); }
  PLAIT_AVX512 inline __m512 load(int64_t k) const {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k))));
  }
};

struct Int4Row16 {
  // A group's 16 possible weights, (q - z) * scale for q = 0..15 (the reference's single rounding),
  // in one register: decoding is then one permute by the nibble, with no convert or multiply.
  const uint8_t* codes; const float* scales; const uint8_t* zeros; float post; __m512 lut;
  PLAIT_AVX512 inline void start(int64_t g) {
    const __m512i q = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i z = _mm512_set1_epi32(zeros ? int32_t(zeros[g]) : 8);
    lut = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(q, z)), _mm512_set1_ps(scales[g]));
  }
  inline const char* at(int64_t k) const { return reinterpret_cast<const char*>(codes + k / 2); }
  PLAIT_AVX512 inline __m512 load(int64_t k) const {
    // Byte i of raw holds elements 2i (low nibble) and 2i + 1 (high). Interleave raw with raw >> 4:
    // lane 2i's low 4 bits are element 2i's code, lane 2i + 1's are element 2i + 1's; the permute
    // reads only those 4 bits of each index, so the bits above need no masking.
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + k / 2));
    const __m128i q = _mm_unpacklo_epi8(raw, _mm_srli_epi16(raw, 4));
    return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(q), lut);
  }
};

template <int MT, int NT, typename Row>
PLAIT_AVX512 static inline void tile16(const float* x, int64_t ldx, Row* rows, int64_t K, int64_t group,
                                       float* out, int64_t ldo) {
  __m512 acc[MT][NT];
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g0 = 0, g = 0; g0 < K; g0 += group, ++g) {
    for (int j = 0; j < NT; ++j) rows[j].start(g);
    for (int64_t k = g0; k < g0 + group; k += 16) {
      __m512 w[NT];
      for (int j = 0; j < NT; ++j) prefetch_ahead(rows[j].at(k));
      for (int j = 0; j < NT; ++j) w[j] = rows[j].load(k);
      for (int i = 0; i < MT; ++i) {
        const __m512 xv = _mm512_loadu_ps(x + i * ldx + k);
        for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_fmadd_ps(xv, w[j], acc[i][j]);
      }
    }
  }
  for (int i = 0; i < MT; ++i)
    for (int j = 0; j < NT; ++j) out[i * ldo + j] = _mm512_reduce_add_ps(acc[i][j]) * rows[j].post;
}

template <int NT, typename Row>
PLAIT_AVX512 static void rows_tile16(const float* x, int64_t M, int64_t K, int64_t group, Row* rows, float* out,
                                     int64_t N) {
  for (int64_t m = 0; m < M; m += 8) {
    const float* xm = x + m * K;
    float* om = out + m * N;
    switch (std::min<int64_t>(8, M - m)) {
      case 1: tile16<1, NT>(xm, K, rows, K, group, om, N); break;
      case 2: tile16<2, NT>(xm, K, rows, K, group, om, N); break;
      case 3: tile16<3, NT>(xm, K, rows, K, group, om, N); break;
      case 4: tile16<4, NT>(xm, K, rows, K, group, om, N); break;
      case 5: tile16<5, NT>(xm, K, rows, K, group, om, N); break;
      case 6: tile16<6, NT>(xm, K, rows, K, group, om, N); break;
      case 7: tile16<7, NT>(xm, K, rows, K, group, om, N); break;
      default: tile16<8, NT>(xm, K, rows, K, group, om, N); break;
    }
  }
}

template <typename MakeRow>
PLAIT_AVX512 static void gemv16_impl(const float* x, int64_t M, int64_t K, int64_t N, int64_t group, float* out,
                                     MakeRow make, int threads) {
  // Up to 4 input rows: 4 weight rows a tile (independent FMA chains); 5 to 8: 2 (registers).
  const int64_t nt = M <= 4 ? 4 : 2;
  const int64_t blocks = (N + nt - 1) / nt;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t n = b * nt;
    if (n + nt <= N) {
      decltype(make(0)) rows[4];
      for (int64_t j = 0; j < nt; ++j) rows[j] = make(n + j);
      if (nt == 4) rows_tile16<4>(x, M, K, group, rows, out + n, N);
      else rows_tile16<2>(x, M, K, group, rows, out + n, N);
    } else {
      for (int64_t j = n; j < N; ++j) {
        decltype(make(0)) row = make(j);
        rows_tile16<1>(x, M, K, group, &row, out + j, N);
      }
    }
  }
}

PLAIT_AVX512 static void gemv16(const float* x, int64_t M, int64_t K, int64_t N, const void* codes,
                                const float* scales, const uint8_t* zeros, int64_t group, float* out, int threads) {
  if (group == 0) {
    const int8_t* cp = static_cast<const int8_t*>(codes);
    gemv16_impl(x, M, K, N, K, out, [=](int64_t n) { return Int8Row16{cp + n * K, scales[n]}; }, threads);
  } else {
    const uint8_t* cp = static_cast<const uint8_t*>(codes);
    const int64_t G = K / group;
    gemv16_impl(x, M, K, N, group, out, [=](int64_t n) {
      return Int4Row16{cp + n * K / 2, scales + n * G, zeros ? zeros + n * G : nullptr, 1.0f, {}};
    }, threads);
  }
}

extern "C" {

// 2 where the CPU runs the AVX-512 GEMV (F, BW, VL, DQ), else 1 (AVX2 + FMA, the library's baseline).
int plait_qmm_isa() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") ? 2 : 1;
}

// out fp32 [M, N] = x fp32 [M, K] @ W^T. group 0: int8 codes [N, K], scales [N]; else int4 codes
// uint8 [N, K/2], scales [N, K/group], zeros uint8 [N, K/group] or NULL (symmetric, z = 8).
// isa: 2 runs the AVX-512 code (the caller checked plait_qmm_isa), anything else the AVX2 code.
void plait_qmm_gemv(const float* x, int64_t M, int64_t K, int64_t N, const void* codes, const float* scales,
                    const uint8_t* zeros, int64_t group, float* out, int threads, int isa) {
  if (isa == 2) {
    gemv16(x, M, K, N, codes, scales, zeros, group, out, threads);
  } else if (group == 0) {
    const int8_t* cp = static_cast<const int8_t*>(codes);
    gemv_impl(x, M, K, N, K, out, [=](int64_t n) { return Int8Row{cp + n * K, scales[n]}; }, threads);
  } else {
    const uint8_t* cp = static_cast<const uint8_t*>(codes);
    const int64_t G = K / group;
    gemv_impl(x, M, K, N, group, out, [=](int64_t n) {
      return Int4Row{cp + n * K / 2, scales + n * G, zeros ? zeros + n * G : nullptr, 1.0f, {}, {}};
    }, threads);
  }
}

// Rows [r0, r1) of the dequantized fp32 weight (K columns) into out [r1 - r0, K].
void plait_qmm_dequantize(const void* codes, const float* scales, const uint8_t* zeros, int64_t group, int64_t K,
                          int64_t r0, int64_t r1, float* out, int threads) {
  const int64_t G = group ? K / group : 1;
#pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int64_t n = r0; n < r1; ++n) {
    float* dst = out + (n - r0) * K;
    if (group == 0) {
      Int8Row row{static_cast<const int8_t*>(codes) + n * K, scales[n]};
      store_row(row, K, K, dst);
    } else {
      Int4Row row{static_cast<const uint8_t*>(codes) + n * K / 2, scales + n * G, zeros ? zeros + n * G : nullptr,
                  1.0f, {}, {}};
      store_row(row, K, group, dst);
    }
  }
}

}  // extern "C"
"""
_FLAGS = ("-O3", "-mavx2", "-mfma", "-fopenmp", "-fPIC", "-shared", "-std=c++17")

ISAS = ("avx2", "avx512")
"""The instruction sets of :func:`gemv`'s code: AVX2 + FMA everywhere, AVX-512 (F/BW/VL/DQ) where the CPU has it."""
build_seconds: float | None = None
"""Seconds the first :func:`load` in this process took (a compile, or loading the cached library)."""
compiled: bool = False
"""Whether that first :func:`load` compiled the library (False: it was in the cache)."""
build_error: str | None = None
"""Why the kernels are not available here (None when they are, or before the first :func:`load`)."""


def cpu_supported() -> bool:
    """Whether this CPU runs AVX2 + FMA code (torch's own dispatch says AVX2 or AVX512)."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def library_path() -> Path:
    """Where the compiled library is cached: ``PLAIT_CACHE_DIR`` (or ``~/.cache/plait``), by source hash."""
    root = Path(os.environ.get("PLAIT_CACHE_DIR") or Path.home() / ".cache" / "plait")
    digest = hashlib.sha256((_SOURCE + " ".join(_FLAGS)).encode()).hexdigest()[:16]
    return root / f"quant_matmul_cpu-{digest}.so"


def _compile(path: Path) -> None:
    """Compile the source into ``path`` (atomically: parallel processes may race to build it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get("CXX", "c++")
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, lib = Path(tmp) / "quant_matmul_cpu.cpp", Path(tmp) / "lib.so"
        src.write_text(_SOURCE)
        subprocess.run([compiler, *_FLAGS, str(src), "-o", str(lib)], check=True, capture_output=True, text=True,
                       timeout=300)
        os.replace(lib, path)


@functools.cache
def load() -> ctypes.CDLL | None:
    """Load the cached library, compiling it first where it is not there; None when it cannot be had.

    Returns:
        The library, or None; then :data:`build_error` says why (no AVX2, no compiler, or the
        compiler's last error line).
    """
    global build_seconds, build_error, compiled
    if not cpu_supported():
        build_error = f"CPU capability {torch.backends.cpu.get_cpu_capability()} has no AVX2"
        return None
    path = library_path()
    start = time.perf_counter()
    try:
        if not path.exists():
            compiler = os.environ.get("CXX", "c++")
            if shutil.which(compiler) is None:
                build_error = f"no C++ compiler ({compiler!r} not found; set CXX)"
                return None
            _compile(path)
            compiled = True
        lib = ctypes.CDLL(str(path))
    except subprocess.CalledProcessError as exc:
        lines = (exc.stderr or "").strip().splitlines()
        build_error = f"compile failed: {lines[-1][:200] if lines else exc}"
        return None
    except (OSError, subprocess.TimeoutExpired) as exc:
        build_error = f"compile or load failed: {exc}"
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    lib.plait_qmm_gemv.argtypes = [ptr, i64, i64, i64, ptr, ptr, ptr, i64, ptr, ctypes.c_int, ctypes.c_int]
    lib.plait_qmm_gemv.restype = None
    lib.plait_qmm_isa.argtypes = []
    lib.plait_qmm_isa.restype = ctypes.c_int
    lib.plait_qmm_dequantize.argtypes = [ptr, ptr, ptr, i64, i64, i64, i64, ptr, ctypes.c_int]
    lib.plait_qmm_dequantize.restype = None
    build_seconds = time.perf_counter() - start
    return lib


def available() -> bool:
    """Whether :func:`gemv` and :func:`dequantize_rows` can run here (compiles on the first call)."""
    return load() is not None


@functools.cache  # asked on every gemv call (decode's hot path): one ctypes call per process
def isas() -> tuple[str, ...]:
    """The instruction sets :func:`gemv` can run here, best last: ``("avx2",)`` or ``("avx2", "avx512")``.

    Raises:
        RuntimeError: the kernels are not available here.
    """
    return ISAS[: _library().plait_qmm_isa()]


def fits(k: int) -> bool:
    """Whether a weight with ``k`` input features fits the kernels (they step 16 elements at a time)."""
    return k % 16 == 0


def _check_weight(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int | None,
                  k: int) -> None:
    int8 = group_size is None
    groups = 1 if int8 else k // group_size
    ok = (codes.dtype == (torch.int8 if int8 else torch.uint8) and codes.dim() == 2
          and codes.shape[1] == (k if int8 else k // 2) and scales.dtype == torch.float32
          and tuple(scales.shape) == (codes.shape[0], groups) and (int8 or k % group_size == 0)
          and (zeros is None or (not int8 and zeros.dtype == torch.uint8 and zeros.shape == scales.shape))
          and all(t is None or t.device.type == "cpu" for t in (codes, scales, zeros)) and fits(k))
    if not ok:
        raise ValueError(f"quant_matmul_cpu: codes {tuple(codes.shape)} {codes.dtype}, scales {tuple(scales.shape)} "
                         f"{scales.dtype} do not form a CPU {'int8' if int8 else 'int4'} weight with K={k} "
                         "(K % 16 == 0); pass quantize_weight's outputs.")


def gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
         group_size: int | None, *, isa: str | None = None) -> torch.Tensor:
    """``x @ dequantize(W)^T`` for fp32 CPU input (any number of rows; built for a few).

    Args:
        x: ``[..., K]`` float32 CPU tensor, ``K % 16 == 0``.
        codes, scales, zeros: an int8 (``group_size=None``) or int4 weight as
            :func:`plait.kernels.ops.quant_matmul.quantize_weight` returns it.
        group_size: the int4 group size, None for int8.
        isa: ``"avx2"`` or ``"avx512"`` (one of :func:`isas`); None picks the best one here.

    Returns:
        ``[..., N]`` float32.

    Raises:
        ValueError: x or the weight does not fit, or ``isa`` is not one of :func:`isas` (named).
        RuntimeError: the kernels are not available here (check :func:`available` first).
    """
    lib = _library()
    if x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"quant_matmul_cpu.gemv: x must be float32 on CPU, got {x.dtype} on {x.device}.")
    _check_weight(codes, scales, zeros, group_size, x.shape[-1])
    here = isas()
    if isa is not None and isa not in here:
        raise ValueError(f"quant_matmul_cpu.gemv: isa={isa!r} cannot run here; use one of {', '.join(here)} or None.")
    level = ISAS.index(isa or here[-1]) + 1
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    codes, scales = codes.contiguous(), scales.contiguous()
    zeros = None if zeros is None else zeros.contiguous()
    out = x2.new_empty(x2.shape[0], codes.shape[0])
    lib.plait_qmm_gemv(x2.data_ptr(), x2.shape[0], x2.shape[1], codes.shape[0], codes.data_ptr(), scales.data_ptr(),
                       None if zeros is None else zeros.data_ptr(), group_size or 0, out.data_ptr(),
                       torch.get_num_threads(), level)
    return out.reshape(*x.shape[:-1], codes.shape[0])


def dequantize_rows(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                    group_size: int | None, start: int, end: int, out: torch.Tensor) -> torch.Tensor:
    """Write weight rows ``[start, end)`` dequantized to fp32 into ``out`` (``[end - start, K]``).

    The values equal :func:`plait.kernels.ops.quant_matmul.dequantize_weight`'s bit for bit.

    Returns:
        ``out``.

    Raises:
        ValueError: the weight, the row range or ``out`` does not fit (named).
        RuntimeError: the kernels are not available here.
    """
    lib = _library()
    k = out.shape[-1] if out.dim() == 2 else -1
    if out.dtype != torch.float32 or not out.is_contiguous() or tuple(out.shape) != (end - start, k) or not (
            0 <= start < end <= codes.shape[0]):
        raise ValueError(f"quant_matmul_cpu.dequantize_rows: rows [{start}, {end}) of {codes.shape[0]} into out "
                         f"{tuple(out.shape)} {out.dtype}: out must be a contiguous float32 [end - start, K].")
    _check_weight(codes, scales, zeros, group_size, k)
    codes, scales = codes.contiguous(), scales.contiguous()
    zeros = None if zeros is None else zeros.contiguous()
    lib.plait_qmm_dequantize(codes.data_ptr(), scales.data_ptr(), None if zeros is None else zeros.data_ptr(),
                             group_size or 0, k, start, end, out.data_ptr(), torch.get_num_threads())
    return out


def _library() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(f"plait's CPU quant_matmul kernels are not available: {build_error}")
    return lib
