// Fused CPU kernels for the bf16 decode path (registered as torch.ops.pagoda_cpu.*).
//
// Why: at a few rows a decode step is ~700 small torch calls, and on this class of CPU
// each costs 5-40 us of dispatch, allocation and OpenMP wake-ups, more than the int4
// matmuls themselves. Each kernel here replaces a chain of such calls with one pass
// over the data. Contracts (shapes, dtypes, what is rounded where) are those of the
// torch ops they replace, written down in kernels/cpu/__init__.py; every elementwise
// result rounds to bf16 exactly where the torch chain rounds, so only reductions
// (a norm's mean of squares, attention's dot products and softmax) may differ from it,
// and those run in fp32 in a fixed order that depends on one row alone (batch
// invariant: a row's result never depends on the other rows of the step).
//
// Inputs are checked here, not trusted: a block id or slot outside the cache fails the
// call (a C++ exception -> a Python RuntimeError), it never reads or writes out of
// bounds.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "gemv.h"
#include "race.h"

namespace {

using bf16 = c10::BFloat16;

inline float f32(bf16 v) { return static_cast<float>(v); }
inline bf16 round_bf16(float v) { return bf16(v); }  // round to nearest even, as torch

// Lanes of the fixed-order reductions: 16 fp32 partial sums, then summed in order.
constexpr int64_t kLanes = 16;

#if defined(__AVX512F__)
// 16 bf16 -> 16 fp32 (exact: a bf16 is the high half of an fp32).
inline __m512 load_bf16x16(const bf16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// fp32 -> the fp32 value of its bf16 rounding (nearest even; NaN -> bf16's quiet NaN),
// bit for bit what c10::BFloat16(float) gives.
inline __m512 round16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  rounded = _mm512_and_si512(rounded, _mm512_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7FC00000));
  return _mm512_castsi512_ps(rounded);
}

// Stores an already-rounded (round16) vector as 16 bf16.
inline void store_bf16x16(bf16* p, __m512 rounded) {
  const __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(rounded), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), half);
}

// e^x, Cephes' expf polynomial (about 1 ulp in fp32); inputs clamped to +-88.37.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-88.3762626647949f)),
                    _mm512_set1_ps(88.3762626647949f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), x);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(y, n);  // y * 2^n
}
#endif

inline float dot_f32_bf16(const float* q, const bf16* k, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += q[i + j] * f32(k[i + j]);
  }
  float sum = 0.f;
  for (; i < n; ++i) sum += q[i] * f32(k[i]);
  for (int64_t j = 0; j < kLanes; ++j) sum += acc[j];
  return sum;
}

inline float sum_squares(const float* x, int64_t n) {
  float acc[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
#pragma omp simd
    for (int64_t j = 0; j < kLanes; ++j) acc[j] += x[i + j] * x[i + j];
  }
  float sum = 0.f;
  for (; i < n; ++i) sum += x[i] * x[i];
  for (int64_t j = 0; j < kLanes; ++j) sum += acc[j];
  return sum;
}

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ",
              t.scalar_type());
}

// Rows of work per parallel chunk so that one chunk is worth waking a thread for.
int64_t grain_rows(int64_t row_cost) {
  constexpr int64_t kMinChunkCost = 32768;
  return std::max<int64_t>(1, kMinChunkCost / std::max<int64_t>(1, row_cost));
}

// (norm(x + residual) * weight, x + residual); without residual (norm(x) * weight, x).
// x, residual: [..., H] contiguous bf16; weight [H] bf16. As the torch chain: the sum
// rounds to bf16; the norm is fp32 (x * rsqrt(mean(x^2) + eps)) rounded to bf16, then
// times weight rounded again; with unit_offset, fp32 normed * (1 + weight) rounded once.
std::tuple<at::Tensor, at::Tensor> rms_norm(const at::Tensor& x_in,
                                            const c10::optional<at::Tensor>& residual_in,
                                            const at::Tensor& weight_in, double eps,
                                            bool unit_offset) {
  check_bf16(x_in, "x");
  check_bf16(weight_in, "weight");
  TORCH_CHECK(x_in.dim() >= 1, "x must have a hidden dim");
  const at::Tensor x = x_in.contiguous(), weight = weight_in.contiguous();
  c10::optional<at::Tensor> residual;
  if (residual_in.has_value()) residual = residual_in->contiguous();
  const int64_t hidden = x.size(-1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == hidden && weight.is_contiguous(),
              "weight must be [", hidden, "]");
  const int64_t rows = hidden ? x.numel() / hidden : 0;
  at::Tensor sum = x;
  const bf16* res = nullptr;
  if (residual.has_value()) {
    check_bf16(*residual, "residual");
    TORCH_CHECK(residual->sizes() == x.sizes(), "residual must be shaped like x");
    sum = at::empty_like(x);
    res = residual->data_ptr<bf16>();
  }
  at::Tensor out = at::empty_like(x);
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* wp = weight.data_ptr<bf16>();
  bf16* sp = sum.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, grain_rows(hidden * 4), [&](int64_t begin, int64_t end) {
    std::vector<float> s(hidden);
#if defined(__AVX512F__)
    if (hidden % 16 == 0) {
      for (int64_t r = begin; r < end; ++r) {
        const bf16* xr = xp + r * hidden;
        __m512 squares = _mm512_setzero_ps();
        for (int64_t j = 0; j < hidden; j += 16) {
          __m512 v = load_bf16x16(xr + j);
          if (res) {
            v = round16(_mm512_add_ps(v, load_bf16x16(res + r * hidden + j)));
            store_bf16x16(sp + r * hidden + j, v);
          }
          _mm512_storeu_ps(s.data() + j, v);
          squares = _mm512_fmadd_ps(v, v, squares);
        }
        const __m512 inv = _mm512_set1_ps(
            1.f / std::sqrt(_mm512_reduce_add_ps(squares) / hidden + feps));
        bf16* orow = op + r * hidden;
        for (int64_t j = 0; j < hidden; j += 16) {
          const __m512 normed = _mm512_mul_ps(_mm512_loadu_ps(s.data() + j), inv);
          const __m512 w = load_bf16x16(wp + j);
          const __m512 y = unit_offset
              ? _mm512_mul_ps(normed, _mm512_add_ps(_mm512_set1_ps(1.f), w))
              : _mm512_mul_ps(w, round16(normed));
          store_bf16x16(orow + j, round16(y));
        }
      }
      return;
    }
#endif
    for (int64_t r = begin; r < end; ++r) {
      const bf16* xr = xp + r * hidden;
      for (int64_t j = 0; j < hidden; ++j) {
        if (res) {
          bf16 rounded = round_bf16(f32(xr[j]) + f32(res[r * hidden + j]));
          sp[r * hidden + j] = rounded;
          s[j] = f32(rounded);
        } else {
          s[j] = f32(xr[j]);
        }
      }
      const float inv = 1.f / std::sqrt(sum_squares(s.data(), hidden) / hidden + feps);
      bf16* orow = op + r * hidden;
      if (unit_offset) {
        for (int64_t j = 0; j < hidden; ++j)
          orow[j] = round_bf16(s[j] * inv * (1.f + f32(wp[j])));
      } else {
        for (int64_t j = 0; j < hidden; ++j)
          orow[j] = round_bf16(f32(wp[j]) * f32(round_bf16(s[j] * inv)));
      }
    }
  });
  return {out, sum};
}

// silu(gate) * up of gate_up [T, 2I] -> [T, I]; silu rounds to bf16, then the product.
at::Tensor silu_and_mul(const at::Tensor& gate_up_in) {
  check_bf16(gate_up_in, "gate_up");
  const at::Tensor gate_up = gate_up_in.contiguous();
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "gate_up needs an even last dim");
  const int64_t width = gate_up.size(-1), inter = width / 2;
  const int64_t rows = width ? gate_up.numel() / width : 0;
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  at::Tensor out = at::empty(sizes, gate_up.options());
  const bf16* in = gate_up.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  at::parallel_for(0, rows, grain_rows(inter * 8), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const bf16* g = in + r * width;
      const bf16* u = g + inter;
      bf16* o = op + r * inter;
      int64_t j = 0;
#if defined(__AVX512F__)
      for (; j + 16 <= inter; j += 16) {
        const __m512 x = load_bf16x16(g + j);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), x));
        const __m512 act = round16(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.f), e)));
        store_bf16x16(o + j, round16(_mm512_mul_ps(act, load_bf16x16(u + j))));
      }
#endif
      for (; j < inter; ++j) {
        const float x = f32(g[j]);
        const bf16 act = round_bf16(x / (1.f + std::exp(-x)));
        o[j] = round_bf16(f32(act) * f32(u[j]));
      }
    }
  });
  return out;
}

// Rotate x [T, heads, D] (rows may be strided, the last dim dense) in the NeoX layout by
// cos, signed_sin [T, R] (R <= D, even): for d < R/2, x[d] * cos[d] + x[d + R/2] *
// sin[d]; for R/2 <= d < R, x[d] * cos[d] + x[d - R/2] * sin[d]; each product and the sum
// rounded to bf16 as torch's `x * cos + cat(x2, x1) * sin`. Dims past R are copied.
// Returns a new contiguous [T, heads, D].
at::Tensor rotary_embedding(const at::Tensor& x, const at::Tensor& cos,
                            const at::Tensor& signed_sin) {
  check_bf16(x, "x");
  check_bf16(cos, "cos");
  check_bf16(signed_sin, "signed_sin");
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "x must be [T, heads, D] with dense rows");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == tokens && cos.is_contiguous() &&
                  signed_sin.sizes() == cos.sizes() && signed_sin.is_contiguous(),
              "cos and signed_sin must be contiguous [T, R]");
  const int64_t rot = cos.size(1), half = rot / 2;
  TORCH_CHECK(rot % 2 == 0 && rot <= dim, "rotary dim must be even and <= head_dim");
  at::Tensor out = at::empty({tokens, heads, dim}, x.options());
  const bf16* xp = x.data_ptr<bf16>();
  const bf16* cp = cos.data_ptr<bf16>();
  const bf16* sp = signed_sin.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, tokens * heads, grain_rows(dim * 4), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / heads, h = i % heads;
      const bf16* xr = xp + t * s0 + h * s1;
      const bf16* c = cp + t * rot;
      const bf16* s = sp + t * rot;
      bf16* o = op + i * dim;
      for (int64_t d = 0; d < rot; ++d) {
        const int64_t partner = d < half ? d + half : d - half;
        const float a = f32(round_bf16(f32(xr[d]) * f32(c[d])));
        const float b = f32(round_bf16(f32(xr[partner]) * f32(s[d])));
        o[d] = round_bf16(a + b);
      }
      for (int64_t d = rot; d < dim; ++d) o[d] = xr[d];
    }
  });
  return out;
}

// key/value [T, Hkv, D] (dense rows) into caches [NB, BS, Hkv, D] at flat slots [T].
void write_kv_cache(const at::Tensor& key, const at::Tensor& value, at::Tensor& key_cache,
                    at::Tensor& value_cache, const at::Tensor& slot_mapping) {
  check_bf16(key, "key");
  check_bf16(value, "value");
  check_bf16(key_cache, "key_cache");
  check_bf16(value_cache, "value_cache");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() && key_cache.dim() == 4,
              "caches must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  const int64_t heads = key_cache.size(2), dim = key_cache.size(3);
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t tokens = slot_mapping.numel();
  for (const at::Tensor* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == heads &&
                    t->size(2) == dim && t->stride(2) == 1,
                "key/value must be [T, kv_heads, head_dim] with dense rows");
  }
  at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(sl[t] >= 0 && sl[t] < num_slots, "slot ", sl[t], " outside the cache");
  bf16* kc = key_cache.data_ptr<bf16>();
  bf16* vc = value_cache.data_ptr<bf16>();
  const bf16* kp = key.data_ptr<bf16>();
  const bf16* vp = value.data_ptr<bf16>();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      std::copy_n(kp + t * key.stride(0) + h * key.stride(1), dim,
                  kc + (sl[t] * heads + h) * dim);
      std::copy_n(vp + t * value.stride(0) + h * value.stride(1), dim,
                  vc + (sl[t] * heads + h) * dim);
    }
  }
}

#if defined(__AVX512F__)
constexpr int64_t kMaxGroup = 16, kMaxChunks = 16;  // query heads per KV head; D / 16
constexpr int64_t kPrefetchRows = 16;  // keys ahead that attend_heads prefetches

// KV heads [h0, h1) of one sequence, each with its `group` query heads (D a multiple of
// 16, <= 256; group <= kMaxGroup). q: [(h1 - h0) * group][dim] fp32, the query heads in
// order; scores: [(h1 - h0) * group][count] scratch; out: the first query head's bf16
// row, the others `out_stride` apart. Same math as attend_one, per query head: a key
// row is loaded and widened once per KV head for its whole group.
//
// Memory: a token's row in the cache holds every KV head, so taking all of a sequence's
// heads in one task reads each key row whole and in order (twice the DRAM throughput of
// reading one head's 128-byte piece of each row). The rows are scattered over blocks of
// a cache far larger than the CPU's and the hardware prefetchers do not follow the
// block table, so rows are prefetched kPrefetchRows keys ahead: keys into L1, values
// into L2 for the second pass (a sequence's values fit in L2 many times over). A query
// head's result does not depend on [h0, h1): per head the arithmetic and its order are
// the same, so the task split never changes an output bit.
void attend_heads(const float* q, int64_t h0, int64_t h1, int64_t group, const bf16* kc,
                  const bf16* vc, const int32_t* table, int64_t first, int64_t len,
                  int64_t block_size, int64_t token_stride, int64_t dim, float scale,
                  float cap, float* scores, float* max_score, float* inv_total, bf16* out,
                  int64_t out_stride) {
  const int64_t chunks = dim / 16, count = len - first, rows = (h1 - h0) * group;
  auto row = [&](const bf16* cache, int64_t k) {
    return cache + (static_cast<int64_t>(table[k / block_size]) * block_size + k % block_size) *
                       token_stride + h0 * dim;
  };
  const int64_t span_bytes = (h1 - h0) * dim * static_cast<int64_t>(sizeof(bf16));
  auto prefetch = [&](const bf16* cache, int64_t k, int64_t bytes, auto hint) {
    const char* p = reinterpret_cast<const char*>(row(cache, k));
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(p + b, hint);
  };
  for (int64_t k = first; k < std::min(len, first + kPrefetchRows); ++k) {
    prefetch(kc, k, span_bytes, _MM_HINT_T0);
    prefetch(vc, k, span_bytes, _MM_HINT_T1);
  }
  for (int64_t r = 0; r < rows; ++r) max_score[r] = -std::numeric_limits<float>::infinity();
  __m512 keys[kMaxChunks];
  for (int64_t k = first; k < len; ++k) {
    if (k + kPrefetchRows < len) {
      prefetch(kc, k + kPrefetchRows, span_bytes, _MM_HINT_T0);
      prefetch(vc, k + kPrefetchRows, span_bytes, _MM_HINT_T1);
    }
    const bf16* key_row = row(kc, k);
    for (int64_t h = 0; h < h1 - h0; ++h) {
      const bf16* key = key_row + h * dim;
      for (int64_t c = 0; c < chunks; ++c) keys[c] = load_bf16x16(key + 16 * c);
      for (int64_t g = 0; g < group; ++g) {
        const int64_t r = h * group + g;
        const float* qg = q + r * dim;
        __m512 sum = _mm512_mul_ps(_mm512_loadu_ps(qg), keys[0]);
        for (int64_t c = 1; c < chunks; ++c)
          sum = _mm512_fmadd_ps(_mm512_loadu_ps(qg + 16 * c), keys[c], sum);
        float sc = _mm512_reduce_add_ps(sum) * scale;
        if (cap > 0.f) sc = cap * std::tanh(sc / cap);
        scores[r * count + (k - first)] = sc;
        max_score[r] = std::max(max_score[r], sc);
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = scores + r * count;
    const __m512 vmax = _mm512_set1_ps(max_score[r]);
    __m512 vtotal = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 16 <= count; k += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sr + k), vmax));
      _mm512_storeu_ps(sr + k, e);
      vtotal = _mm512_add_ps(vtotal, e);
    }
    if (k < count) {  // the tail, masked: lanes past `count` neither read nor written
      const __mmask16 m = static_cast<__mmask16>((1u << (count - k)) - 1);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sr + k), vmax));
      _mm512_mask_storeu_ps(sr + k, m, e);
      vtotal = _mm512_add_ps(vtotal, _mm512_maskz_mov_ps(m, e));
    }
    inv_total[r] = 1.f / _mm512_reduce_add_ps(vtotal);
  }
  const int64_t head_bytes = dim * static_cast<int64_t>(sizeof(bf16));
  for (int64_t h = 0; h < h1 - h0; ++h) {
    __m512 acc[kMaxGroup][kMaxChunks];
    for (int64_t g = 0; g < group; ++g)
      for (int64_t c = 0; c < chunks; ++c) acc[g][c] = _mm512_setzero_ps();
    for (int64_t k = first; k < len; ++k) {
      if (k + kPrefetchRows < len) {
        const char* p = reinterpret_cast<const char*>(row(vc, k + kPrefetchRows) + h * dim);
        for (int64_t b = 0; b < head_bytes; b += 64) _mm_prefetch(p + b, _MM_HINT_T0);
      }
      const bf16* value = row(vc, k) + h * dim;
      for (int64_t c = 0; c < chunks; ++c) keys[c] = load_bf16x16(value + 16 * c);
      for (int64_t g = 0; g < group; ++g) {
        const __m512 p = _mm512_set1_ps(scores[(h * group + g) * count + (k - first)]);
        for (int64_t c = 0; c < chunks; ++c) acc[g][c] = _mm512_fmadd_ps(p, keys[c], acc[g][c]);
      }
    }
    for (int64_t g = 0; g < group; ++g) {
      const __m512 inv = _mm512_set1_ps(inv_total[h * group + g]);
      for (int64_t c = 0; c < chunks; ++c)
        store_bf16x16(out + (h * group + g) * out_stride + 16 * c,
                      round16(_mm512_mul_ps(acc[g][c], inv)));
    }
  }
}
#endif

// Decode attention straight over the paged cache: query [N, H, D] (one token per
// sequence), caches [NB, BS, Hkv, D], block_tables [>= N, W] and seq_lens [>= N] int32.
// Query head h reads KV head h / (H / Hkv). Sequence i's query sits at position
// seq_lens[i] - 1 and sees keys max(0, L - window) <= k < L (window <= 0: all); scores
// are q.k * scale, soft-capped (c * tanh(s / c)) when soft_cap > 0; fp32 softmax and
// fp32 weighted sum of V, rounded to bf16 once. Each (sequence, head) is one task.
// One (sequence, query head) of decode attention: keys first..len-1 of `table`'s blocks.
// Scores go to `scores` [len - first]; the fp32 result to `acc` [dim].
void attend_one(const float* q, const bf16* kc, const bf16* vc, const int32_t* table,
                int64_t first, int64_t len, int64_t block_size, int64_t token_stride,
                int64_t head_offset, int64_t dim, float scale, float cap, float* scores,
                float* acc) {
  auto row = [&](const bf16* cache, int64_t k) {
    return cache + (static_cast<int64_t>(table[k / block_size]) * block_size + k % block_size) *
                       token_stride + head_offset;
  };
  const int64_t count = len - first;
  float max_score = -std::numeric_limits<float>::infinity();
#if defined(__AVX512F__)
  const bool vec = dim % 16 == 0 && dim <= 256;
#else
  const bool vec = false;
#endif
  for (int64_t k = first; k < len; ++k) {
    float s;
#if defined(__AVX512F__)
    if (vec) {
      const bf16* key = row(kc, k);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += 16)
        sum = _mm512_fmadd_ps(_mm512_loadu_ps(q + d), load_bf16x16(key + d), sum);
      s = _mm512_reduce_add_ps(sum) * scale;
    } else
#endif
      s = dot_f32_bf16(q, row(kc, k), dim) * scale;
    if (cap > 0.f) s = cap * std::tanh(s / cap);
    scores[k - first] = s;
    max_score = std::max(max_score, s);
  }
  float total = 0.f;
  int64_t k = 0;
#if defined(__AVX512F__)
  const __m512 vmax = _mm512_set1_ps(max_score);
  __m512 vtotal = _mm512_setzero_ps();
  for (; k + 16 <= count; k += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + k), vmax));
    _mm512_storeu_ps(scores + k, e);
    vtotal = _mm512_add_ps(vtotal, e);
  }
  total = _mm512_reduce_add_ps(vtotal);
#endif
  for (; k < count; ++k) {
    scores[k] = std::exp(scores[k] - max_score);
    total += scores[k];
  }
  const float inv_total = 1.f / total;
#if defined(__AVX512F__)
  if (vec) {
    __m512 out[16];
    for (int64_t c = 0; c < dim / 16; ++c) out[c] = _mm512_setzero_ps();
    for (int64_t k = first; k < len; ++k) {
      const bf16* value = row(vc, k);
      const __m512 p = _mm512_set1_ps(scores[k - first]);
      for (int64_t c = 0; c < dim / 16; ++c)
        out[c] = _mm512_fmadd_ps(p, load_bf16x16(value + 16 * c), out[c]);
    }
    for (int64_t c = 0; c < dim / 16; ++c)
      _mm512_storeu_ps(acc + 16 * c, _mm512_mul_ps(out[c], _mm512_set1_ps(inv_total)));
    return;
  }
#endif
  std::fill(acc, acc + dim, 0.f);
  for (int64_t k = first; k < len; ++k) {
    const bf16* value = row(vc, k);
    const float p = scores[k - first];
    for (int64_t d = 0; d < dim; ++d) acc[d] += p * f32(value[d]);
  }
  for (int64_t d = 0; d < dim; ++d) acc[d] *= inv_total;
}

// Decode attention straight over the paged cache: query [N, H, D] (one token per
// sequence), caches [NB, BS, Hkv, D], block_tables [>= N, W] and seq_lens [>= N] int32.
// Query head h reads KV head h / (H / Hkv). Sequence i's query sits at position
// seq_lens[i] - 1 and sees keys max(0, L - window) <= k < L (window <= 0: all); scores
// are q.k * scale, soft-capped (c * tanh(s / c)) when soft_cap > 0; fp32 softmax and
// fp32 weighted sum of V, rounded to bf16 once. Each (sequence, head) is one task.
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                                  const at::Tensor& seq_lens, double scale, int64_t window,
                                  double soft_cap) {
  check_bf16(query, "query");
  check_bf16(key_cache, "key_cache");
  check_bf16(value_cache, "value_cache");
  TORCH_CHECK(query.dim() == 3 && query.stride(2) == 1, "query must be [N, H, D], dense rows");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  value_cache.sizes() == key_cache.sizes(),
              "caches must be contiguous [num_blocks, block_size, kv_heads, head_dim]");
  const int64_t n = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1);
  const int64_t kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == dim, "head_dim differs between query and cache");
  TORCH_CHECK(kv_heads > 0 && heads % kv_heads == 0, "query heads must be a multiple of kv heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) >= n &&
                  block_tables.scalar_type() == at::kInt && block_tables.stride(1) == 1 &&
                  seq_lens.dim() == 1 && seq_lens.size(0) >= n &&
                  seq_lens.scalar_type() == at::kInt && seq_lens.stride(0) == 1,
              "block_tables [>= N, W] and seq_lens [>= N] int32 expected");
  const int64_t width = block_tables.size(1), table_stride = block_tables.stride(0);
  const int32_t* tp = block_tables.data_ptr<int32_t>();
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  int64_t max_len = 0;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= width * block_size, "sequence ", i, " length ", lp[i],
                " outside 1..", width * block_size);
    const int64_t first_block = window > 0 ? std::max<int64_t>(0, lp[i] - window) / block_size : 0;
    const int64_t used = (lp[i] + block_size - 1) / block_size;
    for (int64_t b = first_block; b < used; ++b) {
      const int32_t id = tp[i * table_stride + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id ", id, " outside the cache");
    }
    max_len = std::max<int64_t>(max_len, lp[i]);
  }
  at::Tensor out = at::empty({n, heads, dim}, query.options());
  const bf16* qp = query.data_ptr<bf16>();
  const bf16* kc = key_cache.data_ptr<bf16>();
  const bf16* vc = value_cache.data_ptr<bf16>();
  bf16* op = out.data_ptr<bf16>();
  const int64_t group = heads / kv_heads;
  const int64_t token_stride = kv_heads * dim;  // between consecutive keys of a block
  const float fscale = static_cast<float>(scale), cap = static_cast<float>(soft_cap);
  const int64_t q0 = query.stride(0), q1 = query.stride(1);
  const int64_t span = window > 0 ? std::min<int64_t>(max_len, window) : max_len;
#if defined(__AVX512F__)
  if (dim % 16 == 0 && dim / 16 <= kMaxChunks && group <= kMaxGroup) {
    // A task is a whole sequence (every KV head: whole cache rows, see attend_heads)
    // when there are enough sequences to keep every thread busy, else one KV head of
    // one. Outputs are the same bits either way.
    const bool whole = n >= 4 * at::get_num_threads();
    const int64_t per_task = whole ? kv_heads : 1;
    at::parallel_for(0, n * kv_heads / per_task, grain_rows(span * dim * 2 * group * per_task),
                     [&](int64_t begin, int64_t end) {
      std::vector<float> q(per_task * group * dim), scores(per_task * group * span),
          max_score(per_task * group), inv_total(per_task * group);
      for (int64_t task = begin; task < end; ++task) {
        const int64_t i = task * per_task / kv_heads, h0 = task * per_task % kv_heads;
        const int64_t len = lp[i];
        const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
        for (int64_t r = 0; r < per_task * group; ++r) {
          const bf16* qrow = qp + i * q0 + (h0 * group + r) * q1;
          for (int64_t d = 0; d < dim; ++d) q[r * dim + d] = f32(qrow[d]);
        }
        attend_heads(q.data(), h0, h0 + per_task, group, kc, vc, tp + i * table_stride, first,
                     len, block_size, token_stride, dim, fscale, cap, scores.data(),
                     max_score.data(), inv_total.data(), op + (i * heads + h0 * group) * dim,
                     dim);
      }
    });
    return out;
  }
#endif
  at::parallel_for(0, n * heads, grain_rows(span * dim * 2), [&](int64_t begin, int64_t end) {
    std::vector<float> q(dim), acc(dim), scores(span);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / heads, h = task % heads;
      const int64_t len = lp[i];
      const int64_t first = window > 0 ? std::max<int64_t>(0, len - window) : 0;
      const bf16* qrow = qp + i * q0 + h * q1;
      for (int64_t d = 0; d < dim; ++d) q[d] = f32(qrow[d]);
      attend_one(q.data(), kc, vc, tp + i * table_stride, first, len, block_size, token_stride,
                 (h / group) * dim, dim, fscale, cap, scores.data(), acc.data());
      bf16* orow = op + (i * heads + h) * dim;
      for (int64_t d = 0; d < dim; ++d) orow[d] = round_bf16(acc[d]);
    }
  });
  return out;
}


// x [T, K] (K = 32 * groups) times a GGUF 4-bit layer's packed weight: the product
// `gguf_int4.SmallBatchInt4Method.apply` takes. A 3-d weight is gemv.h's layout (its
// kernel); a 2-d one torch's int4pack (PAGODA_CPU_GEMV=0: torch's kernel on a dense input).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& weight,
                       const at::Tensor& scales_zeros, int64_t group_size) {
  const at::Tensor x2 = x.reshape({x.size(0), x.size(-1)});
  if (weight.dim() == 3) return pagoda_gemv::int4_gemv(x2, weight, scales_zeros, 0);
  return at::_weight_int4pack_mm_for_cpu(x2.contiguous(), weight, group_size, scales_zeros);
}

// Per layer, the tensors `decode_layers` reads, in this order (see cpu_decode_stack.py).
constexpr int64_t kLayerTensors = 10;

// The decoder layers of a Llama-shaped stack over one step of decodes (one token per
// sequence), in one call: per layer exactly the chain `DecoderLayer.forward` runs on the
// bf16 CPU path with GGUF 4-bit weights (`pagoda.model.cpu_decode_stack` says when):
//   normed, residual = rms_norm(hidden, residual)          (residual None: hidden)
//   qkv = int4(normed); qk = rotary(q and k heads); write k, v; attend(q)
//   normed, residual = rms_norm(int4(attention), residual)
//   hidden = int4(silu_and_mul(int4(normed)))
// with the same kernels, in the same order, on tensors of the same shapes and strides,
// so every output bit is the Python loop's; what goes is the Python between the calls
// (module calls, kernel switches, views: ~70 a layer). hidden [T, hidden] bf16;
// residual None (the first stage's first layer) or like hidden; cos, signed_sin [T, D]
// the rotary tables; weights: kLayerTensors per layer (input norm weight, qkv int4
// weight and scales/zeros, o_proj's, post-attention norm weight, gate_up's, down's);
// block_tables/seq_lens int32 as `paged_decode_attention` reads them. No window, no
// soft-cap, no sinks, no biases, one eps. Returns (last MLP output, residual before it).
std::tuple<at::Tensor, at::Tensor> decode_layers(
    const at::Tensor& hidden_in, const c10::optional<at::Tensor>& residual_in,
    const at::Tensor& cos_in, const at::Tensor& signed_sin_in, at::TensorList weights,
    at::TensorList key_caches, at::TensorList value_caches, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& seq_lens, int64_t num_heads,
    int64_t num_kv_heads, int64_t head_dim, double eps, double scale, int64_t group_size) {
  const int64_t layers = static_cast<int64_t>(key_caches.size());
  TORCH_CHECK(static_cast<int64_t>(value_caches.size()) == layers &&
                  static_cast<int64_t>(weights.size()) == layers * kLayerTensors,
              "decode_layers: ", kLayerTensors, " weights and one cache pair per layer");
  check_bf16(hidden_in, "hidden");
  TORCH_CHECK(hidden_in.dim() == 2, "hidden must be [T, hidden]");
  const int64_t tokens = hidden_in.size(0);
  TORCH_CHECK(slot_mapping.numel() == tokens && seq_lens.size(0) == tokens,
              "decode_layers takes one token per sequence (decodes only)");
  const at::Tensor cos = cos_in.contiguous(), signed_sin = signed_sin_in.contiguous();
  at::Tensor hidden = hidden_in;
  c10::optional<at::Tensor> residual = residual_in;
  const int64_t qk_heads = num_heads + num_kv_heads;
  for (int64_t l = 0; l < layers; ++l) {
    const at::Tensor* w = weights.data() + l * kLayerTensors;
    at::Tensor key_cache = key_caches[l], value_cache = value_caches[l];
    auto [normed, total] = rms_norm(hidden, residual, w[0], eps, false);
    residual = residual.has_value() ? total : hidden;
    const at::Tensor qkv = int4_linear(normed, w[1], w[2], group_size)
                               .view({tokens, qk_heads + num_kv_heads, head_dim});
    const at::Tensor qk = rotary_embedding(qkv.narrow(1, 0, qk_heads), cos, signed_sin);
    write_kv_cache(qk.narrow(1, num_heads, num_kv_heads),
                   qkv.narrow(1, qk_heads, num_kv_heads), key_cache, value_cache, slot_mapping);
    const at::Tensor attended = paged_decode_attention(
        qk.narrow(1, 0, num_heads), key_cache, value_cache, block_tables, seq_lens, scale, 0,
        0.0);
    std::tie(normed, total) = rms_norm(
        int4_linear(attended.view({tokens, num_heads * head_dim}), w[3], w[4], group_size),
        residual, w[5], eps, false);
    residual = total;
    hidden = int4_linear(silu_and_mul(int4_linear(normed, w[6], w[7], group_size)), w[8], w[9],
                         group_size);
  }
  return {hidden, *residual};
}

}  // namespace

TORCH_LIBRARY(pagoda_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps, bool unit_offset)"
        " -> (Tensor, Tensor)", rms_norm);
  m.def("silu_and_mul(Tensor gate_up) -> Tensor", silu_and_mul);
  m.def("rotary_embedding(Tensor x, Tensor cos, Tensor signed_sin) -> Tensor",
        rotary_embedding);
  m.def("write_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache,"
        " Tensor slot_mapping) -> ()", write_kv_cache);
  m.def("paged_decode_attention(Tensor query, Tensor key_cache, Tensor value_cache,"
        " Tensor block_tables, Tensor seq_lens, float scale, int window, float soft_cap)"
        " -> Tensor", paged_decode_attention);
  m.def("decode_layers(Tensor hidden, Tensor? residual, Tensor cos, Tensor signed_sin,"
        " Tensor[] weights, Tensor(a!)[] key_caches, Tensor(b!)[] value_caches,"
        " Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, int num_heads,"
        " int num_kv_heads, int head_dim, float eps, float scale, int group_size)"
        " -> (Tensor, Tensor)", decode_layers);
  m.def("int4_gemv(Tensor x, Tensor packed, Tensor scales, int impl) -> Tensor",
        pagoda_gemv::int4_gemv);
  m.def("int8_gemv(Tensor x, Tensor weight, Tensor scales, int impl) -> Tensor",
        pagoda_gemv::int8_gemv);
  m.def("race_argmax(Tensor logits, Tensor uniforms) -> Tensor", pagoda_race::race_argmax);
  m.def("gemv_vector_isa() -> bool", [] { return pagoda_gemv::cpu_has_avx512_bf16(); });
}
