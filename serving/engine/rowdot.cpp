// Choral's batch-invariant CPU kernels (serving/engine/cpu_kernels.py builds this file with
// torch.utils.cpp_extension.load_inline on first use): rowdot_linear, an fp32 Linear whose rows do
// not depend on how many rows run together, and rowdot_linear_w8a8, the int8 (W8A8) draft kernel.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <vector>

#if defined(__AVX512F__)
typedef __m512 vec;
#define VL 16
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline __m256 half_sum(vec a) {
  return _mm256_add_ps(_mm512_castps512_ps256(a),
                       _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a), 1)));
}
#else
typedef __m256 vec;
#define VL 8
static inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
static inline vec vzero() { return _mm256_setzero_ps(); }
static inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
static inline __m256 half_sum(vec a) { return a; }
#endif

static inline float vsum(vec a) {  // fixed reduction tree
  __m256 s = half_sum(a);
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
}

// NB weight rows against R input rows. Each output has one accumulator that receives the
// same FMAs in the same order whatever NB and R are: that is the batch invariance.
template <int NB, int R>
static inline void block(const float* w, int64_t K, const float* x, float* out, int64_t ldo) {
  vec acc[NB][R];
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = vzero();
  int64_t k = 0;
  for (; k + VL <= K; k += VL) {
    vec wv[NB];
    for (int i = 0; i < NB; ++i) wv[i] = vload(w + i * K + k);
    for (int r = 0; r < R; ++r) {
      vec xv = vload(x + r * K + k);
      for (int i = 0; i < NB; ++i) acc[i][r] = vfma(wv[i], xv, acc[i][r]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < R; ++r) {
      float s = vsum(acc[i][r]);
      for (int64_t j = k; j < K; ++j) s = __builtin_fmaf(w[i * K + j], x[r * K + j], s);
      out[r * ldo + i] = s;
    }
}

// A panel of 8 weight rows is read from memory once; wider row groups use fewer weight
// rows per block so that all accumulators stay in registers (32 with AVX-512, 16 with AVX2).
#if VL == 16
#define WIDE(R) block<8, R>(w, K, xm, o, ldo)
#define NARROW(R) block<4, R>(w, K, xm, o, ldo); block<4, R>(w + 4 * K, K, xm, o + 4, ldo)
#else
#define WIDE(R) block<4, R>(w, K, xm, o, ldo); block<4, R>(w + 4 * K, K, xm, o + 4, ldo)
#define NARROW(R) for (int h = 0; h < 8; h += 2) block<2, R>(w + h * K, K, xm, o + h, ldo)
#endif
static void panel(const float* w, int64_t K, const float* x, int64_t M, float* out, int64_t ldo) {
  for (int64_t m = 0; m < M; m += 6) {
    const float* xm = x + m * K;
    float* o = out + m * ldo;
    switch (std::min<int64_t>(6, M - m)) {
      case 1: WIDE(1); break;
      case 2: WIDE(2); break;
      case 3: NARROW(3); break;
      case 4: NARROW(4); break;
      case 5: NARROW(5); break;
      default: NARROW(6); break;
    }
  }
}

torch::Tensor rowdot_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shape mismatch");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(w.is_contiguous(), "weight must be contiguous");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + 7) / 8, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * 8;
      if (n + 8 <= N) {
        panel(wp + n * K, K, xp, M, yp + n, N);
      } else {
        for (int64_t j = n; j < N; ++j)
          for (int64_t m = 0; m < M; ++m) block<1, 1>(wp + j * K, K, xp + m * K, yp + m * N + j, N);
      }
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// ---- int8 for drafts: weights AND activations in int8, one scale per weight row and one per
// input row (W8A8, per-token dynamic). A draft's numerics never change the speculative output, so
// it may round; what it buys is 1 byte per weight and VNNI's 64 multiply-adds per instruction.
// Integer dot products are exact, so the result is batch-invariant whatever the blocking.
// Weights are stored zero-padded to a multiple of 64 columns (KP); activations are shifted to
// unsigned (q + 128) for vpdpbusd and the shift is undone with the weight row sums.

template <int NB, int R>
static inline void qblock(const int8_t* w, int64_t KP, const uint8_t* x, const float* xs, float* out, int64_t ldo,
                          const float* ws, const int32_t* wsum) {
  int32_t dot[NB][R];
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512i acc[NB][R];
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < R; ++r) acc[i][r] = _mm512_setzero_si512();
  for (int64_t k = 0; k < KP; k += 64) {
    __m512i wv[NB];
    for (int i = 0; i < NB; ++i) wv[i] = _mm512_loadu_si512(w + i * KP + k);
    for (int r = 0; r < R; ++r) {
      __m512i xv = _mm512_loadu_si512(x + r * KP + k);
      for (int i = 0; i < NB; ++i) acc[i][r] = _mm512_dpbusd_epi32(acc[i][r], xv, wv[i]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < R; ++r) dot[i][r] = _mm512_reduce_add_epi32(acc[i][r]);
#elif defined(__AVX2__)
  // No VNNI: widen both to int16 and multiply-add pairs into int32 (vpmaddwd). u8 x s8 pairs sum to
  // at most 2 * 255 * 127, so nothing saturates and the integer dot equals the VNNI path's exactly.
  // Four weight rows at a time keep the accumulators in the 16 ymm registers.
  constexpr int G = NB < 4 ? NB : 4;
  for (int i0 = 0; i0 < NB; i0 += G) {
    __m256i acc[G][R];
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) acc[g][r] = _mm256_setzero_si256();
    for (int64_t k = 0; k < KP; k += 16) {
      __m256i wv[G];
      for (int g = 0; g < G; ++g)
        wv[g] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + (i0 + g) * KP + k)));
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + r * KP + k)));
        for (int g = 0; g < G; ++g) acc[g][r] = _mm256_add_epi32(acc[g][r], _mm256_madd_epi16(xv, wv[g]));
      }
    }
    for (int g = 0; g < G; ++g)
      for (int r = 0; r < R; ++r) {
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(acc[g][r]), _mm256_extracti128_si256(acc[g][r], 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        dot[i0 + g][r] = _mm_cvtsi128_si32(t);
      }
  }
#else
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < R; ++r) {
      int32_t d = 0;
      for (int64_t k = 0; k < KP; ++k) d += int32_t(x[r * KP + k]) * int32_t(w[i * KP + k]);
      dot[i][r] = d;
    }
#endif
  for (int i = 0; i < NB; ++i)
    for (int r = 0; r < R; ++r) out[r * ldo + i] = float(dot[i][r] - 128 * wsum[i]) * xs[r] * ws[i];
}

torch::Tensor rowdot_linear_w8a8(torch::Tensor x, torch::Tensor w, torch::Tensor wscale, torch::Tensor wsum,
                                 c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.size(1) % 64 == 0 && x.size(1) <= w.size(1), "shape mismatch");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar, "fp32 input, int8 weight");
  TORCH_CHECK(wscale.scalar_type() == at::kFloat && wsum.scalar_type() == at::kInt, "fp32 scales, int32 sums");
  TORCH_CHECK(w.is_contiguous() && wscale.is_contiguous() && wsum.is_contiguous(), "contiguous weights");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), KP = w.size(1), N = w.size(0);
  // Quantize each input row on its own (so a row's result never depends on the others).
  std::vector<uint8_t> xq(M * KP, 128);
  std::vector<float> xs(M);
  const float* xp = x.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    float amax = 0.f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(xp[m * K + k]));
    const float s = amax > 0.f ? amax / 127.f : 1.f;
    xs[m] = s;
    for (int64_t k = 0; k < K; ++k) {
      const float q = std::nearbyint(xp[m * K + k] / s);
      xq[m * KP + k] = uint8_t(int32_t(std::min(127.f, std::max(-127.f, q))) + 128);
    }
  }
  auto y = torch::empty({M, N}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = wscale.data_ptr<float>();
  const int32_t* up = wsum.data_ptr<int32_t>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + 7) / 8, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * 8;
      if (n + 8 > N) {
        for (int64_t j = n; j < N; ++j)
          for (int64_t m = 0; m < M; ++m)
            qblock<1, 1>(wp + j * KP, KP, xq.data() + m * KP, xs.data() + m, yp + m * N + j, N, sp + j, up + j);
        continue;
      }
      for (int64_t m = 0; m < M; m += 2) {
        const uint8_t* xm = xq.data() + m * KP;
        float* o = yp + m * N + n;
        if (M - m >= 2)
          qblock<8, 2>(wp + n * KP, KP, xm, xs.data() + m, o, N, sp + n, up + n);
        else
          qblock<8, 1>(wp + n * KP, KP, xm, xs.data() + m, o, N, sp + n, up + n);
      }
    }
  });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}
