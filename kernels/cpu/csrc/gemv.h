// Skinny products of bf16 activations with 4-bit (GGUF Q4_0/Q4_1) and per-row int8
// weights for the decode path at a few rows (issue 28): torch's `_weight_int4pack_mm`
// and `_weight_int8pack_mm` stream the weights at ~20 GB/s here, this at ~2x that.
//
// Activations stay bf16 (never quantized): every weight (q - 8 for 4 bits, the int8
// itself) is exact in bf16 and so is its product with a bf16 activation in fp32, so the
// only rounding is that of fp32 sums, in a fixed order that depends on one row alone
// (batch invariant). Two implementations compute the same bits:
//   - AVX-512 (F/BW/BF16; chosen at run time when the CPU has it, whatever -march):
//     `vdpbf16ps` does 32 products a step for 16 output rows (4-bit), 16-lane FMAs (int8);
//   - portable scalar code, which replays the vector code's lane order exactly: one
//     `vdpbf16ps` lane is acc + w1 x1 then + w0 x0, each rounded (measured on this CPU;
//     tests/kernels/test_cpu_gemv.py compares the two bit for bit).
//
// 4-bit layout (`pack_int4` in pagoda.model.quantization.gguf_int4 builds it from
// q [N, K] of 0..15 and torch's scales_zeros [K/32, N, 2]):
//   packed [N/16, K/32, 256] uint8: tile t (rows 16t..16t+15), group g (k = 32g..32g+31),
//     chunk c (k = 32g + 4c .. +3), byte 2i + j of the chunk (row 16t + i) holds
//     q[.., 32g + 4c + j] in its low nibble and q[.., 32g + 4c + 2 + j] in its high one;
//   scales [N/16, K/32, 2, 16] bf16: the tile's 16 scales, then its 16 zeros;
//   W[n, k] = (q - 8) * scale + zero, so y = sum_g scale * dot_g(q - 8, x) + zero * xsum_g
//   with xsum_g the group's activation sum (fp32, in order).
// int8: weight [N, K] int8 row-major, scales [N] bf16, y = (w . x) * scale; K % 16 == 0.

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

namespace pagoda_gemv {

constexpr int64_t kTileRows = 16, kGroup = 32, kChunks = 8, kGroupBytes = 256;
constexpr int64_t kMaxRowBlock = 4;  // activation rows a tile pass takes at once

inline float bits_to_f32(uint16_t bits) {
  const uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// vdpbf16ps treats denormal inputs as zero and flushes denormal results (DAZ/FTZ).
inline float flush(float v) { return std::fpclassify(v) == FP_SUBNORMAL ? std::copysign(0.f, v) : v; }

// One lane of vdpbf16ps: acc + w1 x1, rounded, then + w0 x0, rounded (products exact).
inline float dp_lane(float acc, float w0, float x0, float w1, float x1) {
  acc = flush(acc + w1 * x1);
  return flush(acc + w0 * x0);
}

inline bool cpu_has_avx512_bf16() {
#if defined(__x86_64__)
  static const bool has = __builtin_cpu_supports("avx512f") &&
                          __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512bf16");
  return has;
#else
  return false;
#endif
}

// ---- 4-bit, portable: one tile (16 output rows) for `rows` activation rows ----
// x: bf16 bits [rows][k]; xsum [rows][groups]; y [rows][16] fp32.
inline void int4_tile_scalar(const uint8_t* q, const uint16_t* sz, int64_t groups,
                             const uint16_t* x, int64_t k, const float* xsum, int64_t rows,
                             float* y) {
  for (int64_t m = 0; m < rows; ++m) {
    const uint16_t* xm = x + m * k;
    for (int64_t i = 0; i < kTileRows; ++i) {
      float acc = 0.f;
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* qg = q + g * kGroupBytes;
        float lo = 0.f, hi = 0.f;
        for (int64_t c = 0; c < kChunks; ++c) {
          const uint8_t b0 = qg[32 * c + 2 * i], b1 = qg[32 * c + 2 * i + 1];
          const uint16_t* xc = xm + g * kGroup + 4 * c;
          const float x0 = flush(bits_to_f32(xc[0])), x1 = flush(bits_to_f32(xc[1]));
          const float x2 = flush(bits_to_f32(xc[2])), x3 = flush(bits_to_f32(xc[3]));
          lo = dp_lane(lo, float((b0 & 15) - 8), x0, float((b1 & 15) - 8), x1);
          hi = dp_lane(hi, float((b0 >> 4) - 8), x2, float((b1 >> 4) - 8), x3);
        }
        const uint16_t* s = sz + g * 2 * kTileRows;
        acc = std::fma(bits_to_f32(s[i]), lo + hi, acc);
        acc = std::fma(bits_to_f32(s[kTileRows + i]), xsum[m * groups + g], acc);
      }
      y[m * kTileRows + i] = acc;
    }
  }
}

#if defined(__x86_64__)
#define PAGODA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")))

PAGODA_AVX512 inline __m512 bf16x16_to_f32(const uint16_t* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// ---- 4-bit, AVX-512: the same sums as int4_tile_scalar, ROWS activation rows ----
template <int ROWS>
PAGODA_AVX512 void int4_tile_avx512(const uint8_t* q, const uint16_t* sz, int64_t groups,
                                    const uint16_t* x, int64_t k, const float* xsum,
                                    float* y) {
  // bf16 bits of (j & 15) - 8 for a 5-bit index j: vpermw reads the low 5 bits only.
  alignas(64) static const uint16_t kTable[32] = {
      0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,
      0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};
  const __m512i table = _mm512_load_si512(kTable);
  __m512 acc[ROWS];
  for (int m = 0; m < ROWS; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* qg = q + g * kGroupBytes;
    _mm_prefetch(reinterpret_cast<const char*>(qg + 16 * kGroupBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(qg + 16 * kGroupBytes + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(qg + 16 * kGroupBytes + 128), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(qg + 16 * kGroupBytes + 192), _MM_HINT_T0);
    __m512 lo[ROWS], hi[ROWS];
    for (int m = 0; m < ROWS; ++m) lo[m] = hi[m] = _mm512_setzero_ps();
    for (int64_t c = 0; c < kChunks; ++c) {
      const __m512i words = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qg + 32 * c)));
      const __m512bh wlo = (__m512bh)_mm512_permutexvar_epi16(words, table);
      const __m512bh whi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
      for (int m = 0; m < ROWS; ++m) {
        const uint16_t* xc = x + m * k + g * kGroup + 4 * c;
        int32_t pair01, pair23;
        std::memcpy(&pair01, xc, 4);
        std::memcpy(&pair23, xc + 2, 4);
        lo[m] = _mm512_dpbf16_ps(lo[m], wlo, (__m512bh)_mm512_set1_epi32(pair01));
        hi[m] = _mm512_dpbf16_ps(hi[m], whi, (__m512bh)_mm512_set1_epi32(pair23));
      }
    }
    const uint16_t* s = sz + g * 2 * kTileRows;
    const __m512 scale = bf16x16_to_f32(s), zero = bf16x16_to_f32(s + kTileRows);
    for (int m = 0; m < ROWS; ++m) {
      acc[m] = _mm512_fmadd_ps(scale, _mm512_add_ps(lo[m], hi[m]), acc[m]);
      acc[m] = _mm512_fmadd_ps(zero, _mm512_set1_ps(xsum[m * groups + g]), acc[m]);
    }
  }
  for (int m = 0; m < ROWS; ++m) _mm512_storeu_ps(y + m * kTileRows, acc[m]);
}

PAGODA_AVX512 inline void int4_tile_avx512_rows(const uint8_t* q, const uint16_t* sz,
                                                int64_t groups, const uint16_t* x, int64_t k,
                                                const float* xsum, int64_t rows, float* y) {
  switch (rows) {
    case 1: return int4_tile_avx512<1>(q, sz, groups, x, k, xsum, y);
    case 2: return int4_tile_avx512<2>(q, sz, groups, x, k, xsum, y);
    case 3: return int4_tile_avx512<3>(q, sz, groups, x, k, xsum, y);
    default: return int4_tile_avx512<4>(q, sz, groups, x, k, xsum, y);
  }
}

#endif  // __x86_64__

// Splits [0, count) into one chunk per thread (the work per item is even).
template <typename F>
void split_even(int64_t count, const F& body) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  at::parallel_for(0, count, std::max<int64_t>(1, (count + threads - 1) / threads), body);
}

// x [M, K] bf16 times the packed 4-bit weight -> [M, N] bf16. impl 0: the best this CPU
// has; 1: the portable code.
at::Tensor int4_gemv(const at::Tensor& x_in, const at::Tensor& packed, const at::Tensor& scales,
                     int64_t impl) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kBFloat16 && x_in.dim() == 2,
              "int4_gemv: x must be a [M, K] bf16 CPU tensor");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.is_contiguous() &&
                  packed.size(2) == kGroupBytes,
              "int4_gemv: packed must be contiguous uint8 [N/16, K/32, 256]");
  const int64_t tiles = packed.size(0), groups = packed.size(1);
  const int64_t m_rows = x_in.size(0), k = x_in.size(1), n = tiles * kTileRows;
  TORCH_CHECK(k == groups * kGroup, "int4_gemv: x has ", k, " columns, the weight ",
              groups * kGroup);
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() &&
                  scales.numel() == tiles * groups * 2 * kTileRows,
              "int4_gemv: scales must be contiguous bf16 [N/16, K/32, 2, 16]");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty({m_rows, n}, x.options());
  if (m_rows == 0 || n == 0) return out;
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  // Each group's activation sum, in order (both implementations read these).
  std::vector<float> xsum(m_rows * groups);
  for (int64_t m = 0; m < m_rows; ++m)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.f;
      for (int64_t j = 0; j < kGroup; ++j) s += bits_to_f32(xp[m * k + g * kGroup + j]);
      xsum[m * groups + g] = s;
    }
  const uint8_t* qp = packed.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<c10::BFloat16>());
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const bool vector = impl == 0 && cpu_has_avx512_bf16();
  split_even(tiles, [&](int64_t begin, int64_t end) {
    float y[kMaxRowBlock * kTileRows];
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* qt = qp + t * groups * kGroupBytes;
      const uint16_t* st = sp + t * groups * 2 * kTileRows;
      for (int64_t m0 = 0; m0 < m_rows; m0 += kMaxRowBlock) {
        const int64_t rows = std::min(kMaxRowBlock, m_rows - m0);
#if defined(__x86_64__)
        if (vector)
          int4_tile_avx512_rows(qt, st, groups, xp + m0 * k, k, xsum.data() + m0 * groups,
                                rows, y);
        else
#endif
          int4_tile_scalar(qt, st, groups, xp + m0 * k, k, xsum.data() + m0 * groups, rows, y);
        for (int64_t m = 0; m < rows; ++m)
          for (int64_t i = 0; i < kTileRows; ++i)
            op[(m0 + m) * n + t * kTileRows + i] = c10::BFloat16(y[m * kTileRows + i]);
      }
    }
  });
  return out;
}

// ---- int8 rows: per output row 16 fp32 lanes over k (lane l takes k = 16j + l), summed
// in lane order, times the row's scale ----
constexpr int64_t kLanes8 = 16, kRowQuad = 4;

inline float int8_row_scalar(const int8_t* w, const float* x, int64_t k) {
  float lanes[kLanes8] = {0.f};
  for (int64_t j = 0; j < k; j += kLanes8)
    for (int64_t l = 0; l < kLanes8; ++l)
      lanes[l] = std::fma(static_cast<float>(w[j + l]), x[j + l], lanes[l]);
  float s = 0.f;
  for (int64_t l = 0; l < kLanes8; ++l) s += lanes[l];
  return s;
}

#if defined(__x86_64__)
PAGODA_AVX512 inline float lane_sum(__m512 v) {
  alignas(64) float lanes[kLanes8];
  _mm512_store_ps(lanes, v);
  float s = 0.f;
  for (int64_t l = 0; l < kLanes8; ++l) s += lanes[l];
  return s;
}

// Rows n0..n0+3 of the weight against ROWS activation rows (fp32 [ROWS][k]) -> dots
// [ROWS][4].
template <int ROWS>
PAGODA_AVX512 void int8_quad_avx512(const int8_t* w, const float* x, int64_t k, float* dots) {
  __m512 acc[kRowQuad][ROWS];
  for (int r = 0; r < kRowQuad; ++r)
    for (int m = 0; m < ROWS; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t j = 0; j < k; j += kLanes8) {
    __m512 xv[ROWS];
    for (int m = 0; m < ROWS; ++m) xv[m] = _mm512_loadu_ps(x + m * k + j);
    for (int r = 0; r < kRowQuad; ++r) {
      const int8_t* wr = w + r * k + j;
      _mm_prefetch(reinterpret_cast<const char*>(wr + 4 * k), _MM_HINT_T0);
      const __m512 wv = _mm512_cvtepi32_ps(
          _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wr))));
      for (int m = 0; m < ROWS; ++m) acc[r][m] = _mm512_fmadd_ps(wv, xv[m], acc[r][m]);
    }
  }
  for (int r = 0; r < kRowQuad; ++r)
    for (int m = 0; m < ROWS; ++m) dots[m * kRowQuad + r] = lane_sum(acc[r][m]);
}

PAGODA_AVX512 inline void int8_quad_avx512_rows(const int8_t* w, const float* x, int64_t k,
                                                int64_t rows, float* dots) {
  switch (rows) {
    case 1: return int8_quad_avx512<1>(w, x, k, dots);
    case 2: return int8_quad_avx512<2>(w, x, k, dots);
    case 3: return int8_quad_avx512<3>(w, x, k, dots);
    default: return int8_quad_avx512<4>(w, x, k, dots);
  }
}

#endif  // __x86_64__

// x [M, K] bf16 times int8 weight [N, K] with per-row scales [N] bf16 -> [M, N] bf16.
at::Tensor int8_gemv(const at::Tensor& x_in, const at::Tensor& weight, const at::Tensor& scales,
                     int64_t impl) {
  TORCH_CHECK(x_in.device().is_cpu() && x_in.scalar_type() == at::kBFloat16 && x_in.dim() == 2,
              "int8_gemv: x must be a [M, K] bf16 CPU tensor");
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.dim() == 2 && weight.is_contiguous(),
              "int8_gemv: weight must be contiguous int8 [N, K]");
  const int64_t m_rows = x_in.size(0), k = x_in.size(1), n = weight.size(0);
  TORCH_CHECK(weight.size(1) == k && k % kLanes8 == 0, "int8_gemv: K must match and be a "
              "multiple of 16, got x ", k, " weight ", weight.size(1));
  TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.is_contiguous() &&
                  scales.numel() == n, "int8_gemv: scales must be contiguous bf16 [N]");
  at::Tensor out = at::empty({m_rows, n}, x_in.options());
  if (m_rows == 0 || n == 0) return out;
  const at::Tensor xf = x_in.to(at::kFloat).contiguous();
  const float* xp = xf.data_ptr<float>();
  const int8_t* wp = weight.data_ptr<int8_t>();
  const c10::BFloat16* sp = scales.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const bool vector = impl == 0 && cpu_has_avx512_bf16();
  const int64_t quads = (n + kRowQuad - 1) / kRowQuad;
  split_even(quads, [&](int64_t begin, int64_t end) {
    float dots[kMaxRowBlock * kRowQuad];
    for (int64_t qd = begin; qd < end; ++qd) {
      const int64_t n0 = qd * kRowQuad, count = std::min(kRowQuad, n - n0);
      for (int64_t m0 = 0; m0 < m_rows; m0 += kMaxRowBlock) {
        const int64_t rows = std::min(kMaxRowBlock, m_rows - m0);
#if defined(__x86_64__)
        if (vector && count == kRowQuad) {
          int8_quad_avx512_rows(wp + n0 * k, xp + m0 * k, k, rows, dots);
        } else
#endif
        {
          for (int64_t m = 0; m < rows; ++m)
            for (int64_t r = 0; r < count; ++r)
              dots[m * kRowQuad + r] = int8_row_scalar(wp + (n0 + r) * k, xp + (m0 + m) * k, k);
        }
        for (int64_t m = 0; m < rows; ++m)
          for (int64_t r = 0; r < count; ++r)
            op[(m0 + m) * n + n0 + r] =
                c10::BFloat16(dots[m * kRowQuad + r] * static_cast<float>(sp[n0 + r]));
      }
    }
  });
  return out;
}

}  // namespace pagoda_gemv
