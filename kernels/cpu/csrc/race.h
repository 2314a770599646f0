// The exponential race of random sampling in one pass (issue 28). For each row of
// logits l [B, V] fp32 (temperature and truncation already applied) and its uniforms
// U [B, V] (the row's one `uniform_` draw, pagoda.sample.sampler), the index of
//   max_i  l_i - ln(-ln U_i)
// which is the sampler's argmax(softmax(l) / E) with E = -ln U taken in the log domain
// (Gumbel-max: ln softmax(l)_i = l_i - logsumexp(l), a constant of the row). Same
// distribution, same draws, without torch's five passes over the vocabulary (softmax,
// log_, neg_, div_, argmax: ~0.15-0.2 ms at 49k here). Unlike the softmax, nothing
// underflows: a token of tiny probability keeps its (tiny) chance. U == 0 gives
// -ln U = inf, score -inf (that token loses this draw), as in the torch path; a -inf
// logit (truncated away) scores -inf. The first index wins a tie, as argmax.
//
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace pagoda_race {

#if defined(__AVX512F__)
// ln x for x > 0 (Cephes' logf, ~1 ulp); ln 0 = -inf. x = 2^e m, m in [sqrt(1/2), sqrt 2).
inline __m512 log16(__m512 x) {
  const __mmask16 zero = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_LE_OQ);
  __m512 m = _mm512_getmant_ps(x, _MM_MANT_NORM_p5_1, _MM_MANT_SIGN_zero);  // [0.5, 1)
  __m512 e = _mm512_add_ps(_mm512_getexp_ps(x), _mm512_set1_ps(1.f));
  const __mmask16 small = _mm512_cmp_ps_mask(m, _mm512_set1_ps(0.707106781186547524f), _CMP_LT_OQ);
  e = _mm512_mask_sub_ps(e, small, e, _mm512_set1_ps(1.f));
  m = _mm512_mask_add_ps(m, small, m, m);
  const __m512 f = _mm512_sub_ps(m, _mm512_set1_ps(1.f));
  const __m512 z = _mm512_mul_ps(f, f);
  __m512 y = _mm512_set1_ps(7.0376836292E-2f);
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.1514610310E-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.1676998740E-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.2420140846E-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(1.4249322787E-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-1.6668057665E-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(2.0000714765E-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(-2.4999993993E-1f));
  y = _mm512_fmadd_ps(y, f, _mm512_set1_ps(3.3333331174E-1f));
  y = _mm512_mul_ps(_mm512_mul_ps(y, f), z);
  y = _mm512_fmadd_ps(e, _mm512_set1_ps(-2.12194440e-4f), y);
  y = _mm512_fnmadd_ps(z, _mm512_set1_ps(0.5f), y);
  __m512 r = _mm512_add_ps(f, y);
  r = _mm512_fmadd_ps(e, _mm512_set1_ps(0.693359375f), r);
  return _mm512_mask_mov_ps(r, zero, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
}
#endif

inline float race_score(float l, float u) { return l - std::log(-std::log(u)); }

// logits, uniforms: [B, V] fp32, rows contiguous -> [B] int64.
at::Tensor race_argmax(const at::Tensor& logits_in, const at::Tensor& uniforms_in) {
  TORCH_CHECK(logits_in.device().is_cpu() && logits_in.scalar_type() == at::kFloat &&
                  logits_in.dim() == 2 && uniforms_in.sizes() == logits_in.sizes() &&
                  uniforms_in.scalar_type() == at::kFloat,
              "race_argmax: logits and uniforms must be fp32 CPU [B, V] of one shape");
  const at::Tensor logits = logits_in.contiguous(), uniforms = uniforms_in.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab > 0, "race_argmax: empty vocabulary");
  at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
  const float* lp = logits.data_ptr<float>();
  const float* up = uniforms.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* l = lp + r * vocab;
      const float* u = up + r * vocab;
      float best = -std::numeric_limits<float>::infinity();
      int64_t best_at = 0;
      int64_t i = 0;
#if defined(__AVX512F__)
      // 16 running (max, index) lanes; ties inside a lane keep the earlier index, and
      // between lanes the smaller index is chosen below.
      __m512 vbest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      __m512i vat = _mm512_setzero_si512();
      __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      const __m512 neg_zero = _mm512_set1_ps(-0.f);
      if (vocab < (int64_t{1} << 31)) {
        for (; i + 16 <= vocab; i += 16) {
          const __m512 e = _mm512_xor_ps(log16(_mm512_loadu_ps(u + i)), neg_zero);  // -ln U
          const __m512 score = _mm512_sub_ps(_mm512_loadu_ps(l + i), log16(e));
          const __mmask16 better = _mm512_cmp_ps_mask(score, vbest, _CMP_GT_OQ);
          vbest = _mm512_mask_mov_ps(vbest, better, score);
          vat = _mm512_mask_mov_epi32(vat, better, idx);
          idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
        }
        alignas(64) float lanes[16];
        alignas(64) int32_t at_lane[16];
        _mm512_store_ps(lanes, vbest);
        _mm512_store_si512(at_lane, vat);
        for (int j = 0; j < 16; ++j) {
          if (lanes[j] > best || (lanes[j] == best && at_lane[j] < best_at)) {
            best = lanes[j];
            best_at = at_lane[j];
          }
        }
      }
#endif
      for (; i < vocab; ++i) {
        const float score = race_score(l[i], u[i]);
        if (score > best) {
          best = score;
          best_at = i;
        }
      }
      op[r] = best_at;
    }
  });
  return out;
}

}  // namespace pagoda_race
