// Choral's batch-invariant CPU kernels (serving/engine/cpu_kernels.py builds this file with
// torch.utils.cpp_extension.load_inline on first use): rowdot_linear, an fp32 Linear whose rows do
// not depend on how many rows run together, and rowdot_linear_w8a8, the int8 (W8A8) draft kernel.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__)
typedef __m512 vec;
#define VL 16
static inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
static inline vec vzero() { return _mm512_setzero_ps(); }
static inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
static inline vec vset1(float x) { return _mm512_set1_ps(x); }
static inline void vstore(float* p, vec a) { _mm512_storeu_ps(p, a); }
static inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }  // b where either is NaN
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
static inline vec vset1(float x) { return _mm256_set1_ps(x); }
static inline void vstore(float* p, vec a) { _mm256_storeu_ps(p, a); }
static inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }  // b where either is NaN
static inline __m256 half_sum(vec a) { return a; }
#endif

static inline float hsum8(__m256 s) {  // fixed reduction tree
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  t = _mm_add_ss(t, _mm_movehdup_ps(t));
  return _mm_cvtss_f32(t);
}
static inline float vsum(vec a) { return hsum8(half_sum(a)); }

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

// Every kernel's outer loop: the output columns in panels of 8 weight rows, spread over threads.
// full(n) computes the whole panel at weight row n; tail(j) one leftover row (N % 8 != 0).
template <class Full, class Tail>
static void over_panels(int64_t N, const Full& full, const Tail& tail) {
  at::parallel_for(0, (N + 7) / 8, 16, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n = b * 8;
      if (n + 8 <= N)
        full(n);
      else
        for (int64_t j = n; j < N; ++j) tail(j);
    }
  });
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
  over_panels(
      N, [&](int64_t n) { panel(wp + n * K, K, xp, M, yp + n, N); },
      [&](int64_t j) {
        for (int64_t m = 0; m < M; ++m) block<1, 1>(wp + j * K, K, xp + m * K, yp + m * N + j, N);
      });
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// The integer kernels' inner loop: the input rows in chunks of at most 8, as even as possible
// (9 rows: 4 + 5), each chunk against one weight row at a time. That weight row's bytes stay in
// registers for every row of the chunk, the weights of a panel stream in address order, and the
// multiply port is the limit once a chunk has a few rows. A chunk's inputs also stay under
// CHUNK_BYTES, so that they remain in L1 while the weights stream past: a down projection's 5
// rows of 8960 int8 inputs (45 KB, more than L1) go in chunks of 2 + 2 + 1, which was faster than
// one chunk of 5 on the AVX-512 VNNI VM despite unpacking each weight row three times.
// f(m, R): rows m .. m + R - 1.
constexpr int64_t CHUNK_BYTES = 24576;
template <class F>
static inline void over_row_chunks(int64_t M, int64_t row_bytes, const F& f) {
  const int64_t most = std::max<int64_t>(1, std::min<int64_t>(8, CHUNK_BYTES / row_bytes));
  const int64_t chunks = (M + most - 1) / most;
  for (int64_t c = 0, m = 0; c < chunks; ++c) {
    const int64_t R = (M - m) / (chunks - c);  // the remaining rows over the remaining chunks
    f(m, R);
    m += R;
  }
}

// f(std::integral_constant<int, R>{}) for a chunk of R rows, 1 <= R <= MAX: the count as a
// template argument, so that the accumulators are registers.
template <int MAX = 8, class F>
static inline void with_rows(int64_t R, const F& f) {
  if constexpr (MAX > 1)
    if (R < MAX) return with_rows<MAX - 1>(R, f);
  f(std::integral_constant<int, MAX>{});
}

// The integer kernels' whole loop: rows(j, m, R) computes weight row j against input rows
// m .. m + R - 1, for every weight row (panels of 8 over threads) and every chunk of input rows.
template <class Rows>
static inline void over_weight_rows(int64_t N, int64_t M, int64_t KP, const Rows& rows) {
  over_panels(
      N,
      [&](int64_t n) {
        over_row_chunks(M, KP, [&](int64_t m, int64_t R) {
          for (int h = 0; h < 8; ++h) rows(n + h, m, R);
        });
      },
      [&](int64_t j) { over_row_chunks(M, KP, [&](int64_t m, int64_t R) { rows(j, m, R); }); });
}

// One input row to symmetric int8: scale = absmax / 127, q = nearbyint(x / scale) clamped to
// +-127, the same arithmetic as a scalar loop (IEEE division, round half to even), so results do
// not depend on the vector width. Writes K values (the padding is the caller's); returns the scale.
static inline float quantize_row(const float* x, int64_t K, int8_t* q) {
  float amax = 0.f;
  int64_t k = 0;
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 vmax = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8) vmax = _mm256_max_ps(_mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)), vmax);  // a NaN never resets the max
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (int i = 0; i < 8; ++i) amax = std::max(amax, lanes[i]);
#endif
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  const float s = amax > 0.f ? amax / 127.f : 1.f;
  k = 0;
#if defined(__AVX2__)
  const __m256 vs = _mm256_set1_ps(s), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  alignas(32) int32_t qi[8];
  for (; k + 8 <= K; k += 8) {
    __m256 v = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + k), vs), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // Operand order as std::min/std::max take it (a NaN quotient clamps to -127, as the scalar loop).
    _mm256_store_si256(reinterpret_cast<__m256i*>(qi), _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi)));
    for (int i = 0; i < 8; ++i) q[k + i] = int8_t(qi[i]);
  }
#endif
  for (; k < K; ++k) q[k] = int8_t(int32_t(std::min(127.f, std::max(-127.f, std::nearbyint(x[k] / s)))));
  return s;
}

// ---- int8 (W8A8): weights AND activations in int8, one scale per weight row and one per input
// row (per-token dynamic). Drafts use it, and targets at target_weights=int8. Integer dot products
// are exact, so the result is batch-invariant whatever the blocking. Weights are stored
// zero-padded to a multiple of 64 columns (KP). VNNI's vpdpbusd takes unsigned activations: there
// they are stored shifted (q + 128) and the shift is undone with the weight row sums.
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int32_t W8A8_SHIFT = 128;
#else
constexpr int32_t W8A8_SHIFT = 0;
#endif

// One weight row against R input rows.
template <int R>
static inline void qrows(const int8_t* w, int64_t KP, const uint8_t* x, const float* xs, float* out, int64_t ldo,
                         float ws, int32_t wsum) {
  int32_t dot[R];
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  __m512i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_si512();
  for (int64_t k = 0; k < KP; k += 64) {
    const __m512i wv = _mm512_loadu_si512(w + k);
    for (int r = 0; r < R; ++r) acc[r] = _mm512_dpbusd_epi32(acc[r], _mm512_loadu_si512(x + r * KP + k), wv);
  }
  for (int r = 0; r < R; ++r) dot[r] = _mm512_reduce_add_epi32(acc[r]);
#elif defined(__AVX2__)
  // No VNNI: vpmaddubsw multiplies |w| (unsigned) by x carrying w's sign; a pair of products is at
  // most 2 * 127 * 127, so nothing saturates, and vpmaddwd by ones widens to int32. The integer
  // dot is the VNNI path's exactly.
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
  for (int64_t k = 0; k < KP; k += 32) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k));
    const __m256i aw = _mm256_abs_epi8(wv);
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + r * KP + k));
      acc[r] = _mm256_add_epi32(acc[r], _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wv)), ones));
    }
  }
  for (int r = 0; r < R; ++r) {
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(acc[r]), _mm256_extracti128_si256(acc[r], 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    dot[r] = _mm_cvtsi128_si32(t);
  }
#else
  for (int r = 0; r < R; ++r) {
    int32_t d = 0;
    for (int64_t k = 0; k < KP; ++k) d += int32_t(int8_t(x[r * KP + k])) * int32_t(w[k]);
    dot[r] = d;
  }
#endif
  for (int r = 0; r < R; ++r) out[r * ldo] = float(dot[r] - W8A8_SHIFT * wsum) * xs[r] * ws;
}

// ---- AMX (Intel's tile unit, Sapphire Rapids and later) for the int8 kernel. A W8A8 row's integer
// dot is exact whichever unit sums it, and the float work after it is the same expression as qrows',
// so every output is bitwise the VNNI path's. Calls of two rows or more (verifies, prefills) run on
// it; a one-row step stays on VNNI, which was as fast or faster there on the Intel VM of 2026-11-27
// (scripts/experiments/int8_peak.py, its int8 and int8-vnni rows; docs/experiments/q4-target.md).
// Tiles: weights as A (16 output rows x 64 bytes, signed), inputs as B (16 rows of 4-byte groups x
// up to 16 input rows, unsigned: shifted as for vpdpbusd), so C[o][r] is qrows' dot before its
// reduction. Linux grants the tile state only on request (arch_prctl), once per process.
#if defined(__AMX_INT8__) && defined(__AMX_TILE__) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && \
    defined(__linux__) && !defined(CHORAL_NO_AMX)
#define CHORAL_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#else
#define CHORAL_AMX 0
#endif

static std::atomic<bool>& amx_on() {  // on by default; the tests turn it off to compare
  static std::atomic<bool> on{true};
  return on;
}

static bool amx_granted() {
#if CHORAL_AMX
  static const bool granted = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return granted;
#else
  return false;
#endif
}

// rowdot_amx(-1) says whether multi-row int8 calls run on AMX; rowdot_amx(0 or 1) turns that off or
// back on (where the CPU and kernel have it) and says the same. The tests compare both ways.
bool rowdot_amx(int64_t want) {
  if (want >= 0) amx_on() = want > 0;
  return amx_on() && amx_granted();
}

#if CHORAL_AMX
constexpr int64_t AMX_ROWS = 16;   // input rows per B tile
constexpr int64_t AMX_PANEL = 32;  // weight rows per pass: two A tiles share each B tile
constexpr int64_t AMX_MIN_ROWS = 2;   // input rows from which a call runs on AMX

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Weight rows [0, P * 32) against every input row on AMX; the caller does the rest on VNNI.
static void w8a8_amx(const int8_t* w, int64_t KP, int64_t N, const uint8_t* xq, int64_t M, const float* xs,
                     const float* ws, const int32_t* wsum, float* y) {
  const int64_t P = N / AMX_PANEL, chunks = (M + AMX_ROWS - 1) / AMX_ROWS;
  const int64_t RC = (M + chunks - 1) / chunks;  // every chunk this wide; the last one padded
  const int64_t K4 = KP / 4;
  // B tiles' rows: 4-byte groups of the inputs, the chunk's RC rows side by side, [chunks][K4][RC].
  std::vector<int32_t> xb(chunks * K4 * RC, 0);
  for (int64_t m = 0; m < M; ++m) {
    int32_t* dst = xb.data() + (m / RC) * K4 * RC + m % RC;
    for (int64_t j = 0; j < K4; ++j) std::memcpy(dst + j * RC, xq + m * KP + 4 * j, 4);
  }
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    TileConfig cfg;
    for (int t : {0, 1}) cfg.rows[t] = 16, cfg.colsb[t] = 64;                     // A: weights
    cfg.rows[2] = 16, cfg.colsb[2] = uint16_t(RC * 4);                             // B: inputs
    for (int t : {3, 4}) cfg.rows[t] = 16, cfg.colsb[t] = uint16_t(RC * 4);       // C: dots
    // gcc 12 does not count ldtilecfg as reading the config: without this it may drop the stores
    // above as dead (it did in int8_peak.py's C loop, which then died at its first tile load).
    __asm__ volatile("" : : "r"(&cfg) : "memory");
    _tile_loadconfig(&cfg);
    alignas(64) int32_t dots[AMX_PANEL][AMX_ROWS];
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n = p * AMX_PANEL;
      const int8_t* w0 = w + n * KP;
      const int8_t* w1 = w0 + 16 * KP;
      for (int64_t c = 0; c < chunks; ++c) {
        const int32_t* b = xb.data() + c * K4 * RC;
        _tile_zero(3);
        _tile_zero(4);
        // The next panel's 32 rows are one contiguous run of memory: ask for it, 2 KB a step, while
        // the tiles read this panel column by column (32 strided streams the prefetchers lose). Into
        // L2: the next panel is as large as L1 (48 KB at 1536 inputs).
        const char* ahead = reinterpret_cast<const char*>(w0 + AMX_PANEL * KP);
        const bool fetch = c == 0 && p + 1 < p1;
        for (int64_t k = 0; k < KP; k += 64) {
          if (fetch)
            for (int l = 0; l < 32; ++l) _mm_prefetch(ahead + (k / 64 * 32 + l) * 64, _MM_HINT_T1);
          _tile_loadd(0, w0 + k, KP);
          _tile_loadd(1, w1 + k, KP);
          _tile_loadd(2, b + (k / 4) * RC, RC * 4);
          _tile_dpbsud(3, 0, 2);
          _tile_dpbsud(4, 1, 2);
        }
        _tile_stored(3, dots[0], AMX_ROWS * 4);
        _tile_stored(4, dots[16], AMX_ROWS * 4);
        for (int64_t r = 0; r < RC && c * RC + r < M; ++r) {
          const int64_t m = c * RC + r;
          for (int o = 0; o < AMX_PANEL; ++o)  // qrows' expression, term for term
            y[m * N + n + o] = float(dots[o][r] - W8A8_SHIFT * wsum[n + o]) * xs[m] * ws[n + o];
        }
      }
    }
    _tile_release();
  });
}
#endif

torch::Tensor rowdot_linear_w8a8(torch::Tensor x, torch::Tensor w, torch::Tensor wscale, torch::Tensor wsum,
                                 c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && w.size(1) % 64 == 0 && w.size(1) > 0 && x.size(1) <= w.size(1), "shape mismatch");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kChar, "fp32 input, int8 weight");
  TORCH_CHECK(wscale.scalar_type() == at::kFloat && wsum.scalar_type() == at::kInt, "fp32 scales, int32 sums");
  TORCH_CHECK(w.is_contiguous() && wscale.is_contiguous() && wsum.is_contiguous(), "contiguous weights");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), KP = w.size(1), N = w.size(0);
  // Quantize each input row on its own (so a row's result never depends on the others).
  std::vector<uint8_t> xq(M * KP, uint8_t(W8A8_SHIFT));
  std::vector<float> xs(M);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      xs[m] = quantize_row(xp + m * K, K, reinterpret_cast<int8_t*>(xq.data()) + m * KP);
      if (W8A8_SHIFT)
        for (int64_t k = 0; k < K; ++k) xq[m * KP + k] = uint8_t(int32_t(int8_t(xq[m * KP + k])) + W8A8_SHIFT);
    }
  });
  auto y = torch::empty({M, N}, x.options());
  const int8_t* wp = w.data_ptr<int8_t>();
  const float* sp = wscale.data_ptr<float>();
  const int32_t* up = wsum.data_ptr<int32_t>();
  float* yp = y.data_ptr<float>();
  auto rows = [&](int64_t j, int64_t m, int64_t R) {
    with_rows(R, [&](auto r) {
      qrows<decltype(r)::value>(wp + j * KP, KP, xq.data() + m * KP, xs.data() + m, yp + m * N + j, N, sp[j], up[j]);
    });
  };
#if CHORAL_AMX
  if (M >= AMX_MIN_ROWS && N >= AMX_PANEL && rowdot_amx(-1)) {
    w8a8_amx(wp, KP, N, xq.data(), M, xs.data(), sp, up, yp);
    const int64_t done = N / AMX_PANEL * AMX_PANEL;  // the last N % 32 weight rows on VNNI
    for (int64_t j = done; j < N; ++j) over_row_chunks(M, KP, [&](int64_t m, int64_t R) { rows(j, m, R); });
  } else
#endif
    over_weight_rows(N, M, KP, rows);
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// ---- 4-bit weights for a target (W4A8): the GGUF's Q4_K sub-blocks, one group of 32 weights per
// (step d, minimum m) with 4-bit q in 0..15, value = d * q + m. Inputs are int8 per row (scale a,
// as in W8A8) with per-group sums X. For one output o and one input row:
//   y = a * (D + M),  D = sum_g d_g * S_g,  M = sum_g m_g * X_g,  S_g = sum over the group of q * xq,
// S_g and X_g exact integers, D and M each one fp32 FMA chain over the groups in order.
//
// Every output is its own chain, and vectors hold outputs side by side (16 to an AVX-512 register, 8
// to an AVX2 one), so no output's arithmetic depends on the vector width, on the unit that summed its
// integers (AMX, VNNI, AVX2 or scalar), on the number of rows or on how they are chunked: a verify row
// is bitwise its one-token step, and this kernel gives the same bits on every x86 CPU kind.
//
// Layout: the outputs in panels of 16 (the last padded with zero weights, steps and minimums), the
// inputs in groups of 32. A panel's group is 256 bytes, four 64-byte vectors v: byte 4o + c holds
// output o's weight 4v + c in its low nibble and 16 + 4v + c in its high nibble. Unpacked, the low
// nibbles of vector v are row v and the high ones row v + 4 of an 8 x 64-byte block whose row k holds
// each output's weights 4k .. 4k + 3: an AMX B tile as tdpbsud reads it, and for vpdpbusd, the 16
// outputs' products with one broadcast 4 bytes of input. Steps and minimums: fp16 [panel][group][16].
constexpr int64_t Q4_PANEL = 16;   // outputs per panel
constexpr int64_t Q4_GBYTES = 256; // bytes of one panel's group of 32 weights
// How far ahead (bytes) the vector path asks for the weights it streams when a call has more than
// one input row: it then computes long enough per byte that the hardware prefetcher alone falls
// behind. A one-row call streams as fast as memory allows without it.
constexpr int64_t Q4_PREFETCH = 2048;

// CHORAL_Q4_PATH (a compile flag) forces a path: the tests build the others to compare them.
#if defined(CHORAL_Q4_PATH)
#define Q4_PATH CHORAL_Q4_PATH
#elif defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define Q4_PATH 2
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define Q4_PATH 1
#else
#define Q4_PATH 0
#endif

static inline int32_t load4(const int8_t* p) {  // 4 input bytes, for a broadcast
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if Q4_PATH == 2
// One 64-byte vector of a panel's group: its low nibbles (tile row v) and its high ones (row v + 4).
static inline void q4_nibbles(const uint8_t* p, __m512i& lo, __m512i& hi) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), b = _mm512_loadu_si512(p);
  lo = _mm512_and_si512(b, low4);
  hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), low4);
}

// y = a * (D + M) for R rows of one panel, given each row's D (acc) and M (mb), for the outputs of
// the panel that exist (valid of 16).
template <int R>
static inline void q4_store(const __m512* acc, const __m512* mb, const float* xa, float* out, int64_t ldo,
                            int64_t valid) {
  const __mmask16 keep = __mmask16((1u << valid) - 1u);
  for (int r = 0; r < R; ++r)
    _mm512_mask_storeu_ps(out + r * ldo, keep, _mm512_mul_ps(_mm512_set1_ps(xa[r]), _mm512_add_ps(acc[r], mb[r])));
}

// The minimums' chains M = sum_g m_g * X_g of R rows, then q4_store. Each row's chain runs over the
// groups in order; the rows' chains are interleaved (group by group, row by row), so that R chains
// are in flight instead of one FMA's latency per group and row.
template <int R>
static inline void q4_finish(const __m512* acc, const at::Half* mn, int64_t G, const float* xsum, const float* xa,
                             float* out, int64_t ldo, int64_t valid) {
  __m512 mb[R];
  for (int r = 0; r < R; ++r) mb[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn + g * 16)));
    for (int r = 0; r < R; ++r) mb[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[r * G + g]), mb[r]);
  }
  q4_store<R>(acc, mb, xa, out, ldo, valid);
}
#endif

// One panel (w: its G groups, d and mn: its steps and minimums) against R input rows (x, KP bytes
// apart) on the vector units. The integer sums are exact in any order, so a group's eight vpdpbusd
// per row run as two chains (low and high nibbles) added at the end.
template <int R>
static inline void q4panel(const uint8_t* w, const at::Half* d, const at::Half* mn, int64_t G, const int8_t* x,
                           int64_t KP, const float* xsum, const float* xa, float* out, int64_t ldo, int64_t valid) {
#if Q4_PATH == 2
  // D's and M's chains advance together, group by group: M's FMA latency hides behind D's work
  // instead of running as a second serial pass over the groups.
  __m512 acc[R], mb[R];
  for (int r = 0; r < R; ++r) acc[r] = mb[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* wg = w + g * Q4_GBYTES;
    if (R > 1)
      for (int c = 0; c < Q4_GBYTES; c += 64) _mm_prefetch(reinterpret_cast<const char*>(wg + Q4_PREFETCH + c), _MM_HINT_T0);
    __m512i lo[4], hi[4];
    for (int v = 0; v < 4; ++v) q4_nibbles(wg + v * 64, lo[v], hi[v]);
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * 16)));
    const __m512 mv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn + g * 16)));
    for (int r = 0; r < R; ++r) {  // nibbles unsigned, inputs signed
      const int8_t* xr = x + r * KP + g * 32;
      __m512i t0 = _mm512_setzero_si512(), t1 = _mm512_setzero_si512();
      for (int v = 0; v < 4; ++v) {
        t0 = _mm512_dpbusd_epi32(t0, lo[v], _mm512_set1_epi32(load4(xr + 4 * v)));
        t1 = _mm512_dpbusd_epi32(t1, hi[v], _mm512_set1_epi32(load4(xr + 16 + 4 * v)));
      }
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(t0, t1)), dv, acc[r]);
      mb[r] = _mm512_fmadd_ps(mv, _mm512_set1_ps(xsum[r * G + g]), mb[r]);
    }
  }
  q4_store<R>(acc, mb, xa, out, ldo, valid);
#elif Q4_PATH == 1
  // Outputs 0-7 and 8-15 of the panel as two 8-lane halves; the same per-output arithmetic.
  const __m256i low4 = _mm256_set1_epi8(0x0F);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int half = 0; half < 2; ++half) {
    if (half * 8 >= valid) break;
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const uint8_t* wg = w + g * Q4_GBYTES + half * 32;
      __m256i lo[4], hi[4];
      for (int v = 0; v < 4; ++v) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wg + v * 64));
        lo[v] = _mm256_and_si256(b, low4);
        hi[v] = _mm256_and_si256(_mm256_srli_epi16(b, 4), low4);
      }
      const __m256 dv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + g * 16 + half * 8)));
      for (int r = 0; r < R; ++r) {
        const int8_t* xr = x + r * KP + g * 32;
        // u8 (0..15) x s8 pairs: a vpmaddubsw lane is at most 2 * 15 * 127 = 3810 in size, so the
        // eight of a group (4 vectors v, low and high nibbles) sum to at most 30480: exact in int16.
        __m256i t = _mm256_setzero_si256();
        for (int v = 0; v < 4; ++v)
          t = _mm256_add_epi16(t, _mm256_add_epi16(_mm256_maddubs_epi16(lo[v], _mm256_set1_epi32(load4(xr + 4 * v))),
                                                   _mm256_maddubs_epi16(hi[v], _mm256_set1_epi32(load4(xr + 16 + 4 * v)))));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(t, ones)), dv, acc[r]);
      }
    }
    __m256 mb[R];  // the minimums' chains, the rows' interleaved (as q4_finish)
    for (int r = 0; r < R; ++r) mb[r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < G; ++g) {
      const __m256 mv = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn + g * 16 + half * 8)));
      for (int r = 0; r < R; ++r) mb[r] = _mm256_fmadd_ps(mv, _mm256_set1_ps(xsum[r * G + g]), mb[r]);
    }
    for (int r = 0; r < R; ++r) {
      alignas(32) float y[8];
      _mm256_store_ps(y, _mm256_mul_ps(_mm256_set1_ps(xa[r]), _mm256_add_ps(acc[r], mb[r])));
      for (int o = 0; o < 8 && half * 8 + o < valid; ++o) out[r * ldo + half * 8 + o] = y[o];
    }
  }
#else
  for (int r = 0; r < R; ++r)
    for (int64_t o = 0; o < valid; ++o) {
      float a = 0.f, b = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        int32_t s = 0;
        for (int v = 0; v < 4; ++v)
          for (int c = 0; c < 4; ++c) {
            const uint8_t q = w[g * Q4_GBYTES + v * 64 + o * 4 + c];
            s += int32_t(q & 0x0F) * x[r * KP + g * 32 + 4 * v + c];
            s += int32_t(q >> 4) * x[r * KP + g * 32 + 16 + 4 * v + c];
          }
        a = std::fma(float(s), float(d[g * 16 + o]), a);
      }
      for (int64_t g = 0; g < G; ++g) b = std::fma(float(mn[g * 16 + o]), xsum[r * G + g], b);
      out[r * ldo + o] = xa[r] * (a + b);
    }
#endif
}

// ---- The 4-bit kernel on AMX. A tile holds up to 16 input rows x one group (32 bytes, signed), B
// one panel's unpacked group (8 x 64 bytes, unsigned), so C[r][o] is S_g for 16 outputs at once; the
// float work after it is q4panel's, output by output, group by group.
#if CHORAL_AMX && Q4_PATH == 2
// Input rows from which a call runs on AMX. Below it the vector path was as fast or faster on the
// Intel VM of 2026-11-27: each group's sums leave the tiles through memory (tilestored, 16 rows of 64
// bytes), and with the tile loads that is most of a tile pass. On the bundled target's shapes AMX was
// 1.17-1.26x the vector path at 32-33 rows and 1.39-1.70x at 64-170 once both paths interleaved their
// minimums' chains (compare_kernels.py --amx-vs-vector; docs/experiments/q4-target.md, sixth session),
// and 0.5-0.8x at 2-8 rows in an earlier probe.
constexpr int64_t Q4_AMX_MIN_ROWS = 32;

// Unpacks a panel's G groups (packed, 256 bytes each) into B tiles (512 bytes each, out 64-aligned).
static inline void q4_unpack(const uint8_t* w, int64_t G, uint8_t* out) {
  for (int64_t i = 0; i < G; ++i)
    for (int v = 0; v < 4; ++v) {
      __m512i lo, hi;
      q4_nibbles(w + i * Q4_GBYTES + v * 64, lo, hi);
      _mm512_store_si512(out + i * 512 + v * 64, lo);
      _mm512_store_si512(out + i * 512 + (v + 4) * 64, hi);
    }
}

// RC rows against one panel, its groups unpacked in wu.
template <int RC>
static inline void q4_amx_rows(const uint8_t* wu, const at::Half* d, const at::Half* mn, int64_t G, const int8_t* x,
                               int64_t KP, const float* xsum, const float* xa, float* out, int64_t ldo, int64_t valid,
                               int32_t* dots) {
  __m512 acc[RC];
  for (int r = 0; r < RC; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; g += 2) {  // two groups in flight: tiles 0-2 and 3-5
    const bool two = g + 1 < G;
    const uint8_t* b = wu + g * 512;
    _tile_loadd(0, x + g * 32, KP);
    _tile_loadd(1, b, 64);
    _tile_zero(2);
    _tile_dpbsud(2, 0, 1);
    _tile_stored(2, dots, 64);
    if (two) {
      _tile_loadd(3, x + g * 32 + 32, KP);
      _tile_loadd(4, b + 512, 64);
      _tile_zero(5);
      _tile_dpbsud(5, 3, 4);
      _tile_stored(5, dots + 256, 64);
    }
    for (int h = 0; h < (two ? 2 : 1); ++h) {  // q4panel's float work, group by group
      const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + (g + h) * 16)));
      for (int r = 0; r < RC; ++r)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(dots + h * 256 + r * 16)), dv, acc[r]);
    }
  }
  q4_finish<RC>(acc, mn, G, xsum, xa, out, ldo, valid);
}

// Panels [p0, p1) against all M rows, in chunks of 16 rows. A panel's groups are unpacked once per
// call into a buffer of B tiles (512 bytes a group: 140 KB for an 8960-wide input, in L2).
static void q4_amx(const uint8_t* w, const at::Half* d, const at::Half* mn, int64_t G, int64_t N, const int8_t* xq,
                   int64_t KP, int64_t M, const float* xsum, const float* xa, float* y, int64_t p0, int64_t p1) {
  std::unique_ptr<uint8_t[]> buf(new uint8_t[G * 512 + 64]);  // every byte is written before it is read
  uint8_t* wu = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(buf.get()) + 63) & ~uintptr_t(63));
  const int64_t chunks = (M + 15) / 16;
  alignas(64) int32_t dots[2 * 256];
  TileConfig cfg;
  int64_t configured = 0;
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* wp = w + p * G * Q4_GBYTES;
    q4_unpack(wp, G, wu);
    const int64_t valid = std::min<int64_t>(Q4_PANEL, N - p * Q4_PANEL);
    for (int64_t c = 0, m = 0; c < chunks; ++c) {
      const int64_t RC = (M - m) / (chunks - c);  // as even as possible: 33 rows are 11 + 11 + 11
      if (RC != configured) {
        for (int t : {0, 3}) cfg.rows[t] = uint8_t(RC), cfg.colsb[t] = 32;  // A: inputs
        for (int t : {1, 4}) cfg.rows[t] = 8, cfg.colsb[t] = 64;            // B: weights
        for (int t : {2, 5}) cfg.rows[t] = uint8_t(RC), cfg.colsb[t] = 64;  // C: S_g
        __asm__ volatile("" : : "r"(&cfg) : "memory");  // see w8a8_amx
        _tile_loadconfig(&cfg);
        configured = RC;
      }
      with_rows<16>(RC, [&](auto r) {
        q4_amx_rows<decltype(r)::value>(wu, d + p * G * 16, mn + p * G * 16, G, xq + m * KP, KP, xsum + m * G, xa + m,
                                        y + m * N + p * Q4_PANEL, N, valid, dots);
      });
      m += RC;
    }
  }
  if (configured) _tile_release();
}
#endif

// x [M, K] fp32; w [P, G * 256] uint8, d and mn [P, G * 16] fp16 (the layout above); N outputs.
torch::Tensor rowdot_linear_w4a8(torch::Tensor x, torch::Tensor w, torch::Tensor d, torch::Tensor mn, int64_t N,
                                 c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && d.dim() == 2 && mn.sizes() == d.sizes(), "shape mismatch");
  const int64_t M = x.size(0), K = x.size(1), P = w.size(0), G = w.size(1) / Q4_GBYTES, KP = G * 32;
  TORCH_CHECK(G > 0 && w.size(1) == G * Q4_GBYTES && d.size(0) == P && d.size(1) == G * 16 && K <= KP &&
              P == (N + Q4_PANEL - 1) / Q4_PANEL, "shape mismatch");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kByte, "fp32 input, uint8 packed weight");
  TORCH_CHECK(d.scalar_type() == at::kHalf && mn.scalar_type() == at::kHalf, "fp16 scales and minimums");
  TORCH_CHECK(w.is_contiguous() && d.is_contiguous() && mn.is_contiguous(), "contiguous weights");
  x = x.contiguous();
  std::vector<int8_t> xq(M * KP, 0);
  std::vector<float> xa(M), xsum(M * G);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      int8_t* row = xq.data() + m * KP;
      xa[m] = quantize_row(xp + m * K, K, row);
      for (int64_t g = 0; g < G; ++g) {
        int32_t s = 0;
        for (int j = 0; j < 32; ++j) s += row[g * 32 + j];
        xsum[m * G + g] = float(s);
      }
    }
  });
  auto y = torch::empty({M, N}, x.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const at::Half* dp = d.data_ptr<at::Half>();
  const at::Half* mp = mn.data_ptr<at::Half>();
  float* yp = y.data_ptr<float>();
#if CHORAL_AMX && Q4_PATH == 2
  if (M >= Q4_AMX_MIN_ROWS && rowdot_amx(-1)) {
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      q4_amx(wp, dp, mp, G, N, xq.data(), KP, M, xsum.data(), xa.data(), yp, p0, p1);
    });
  } else
#endif
  {
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t valid = std::min<int64_t>(Q4_PANEL, N - p * Q4_PANEL);
        // Chunks of at most 8 rows, whatever their width (a row size of 1 byte lifts CHUNK_BYTES'
        // limit): a group's 32 input bytes per row are read as the weights stream past.
        over_row_chunks(M, 1, [&](int64_t m, int64_t R) {
          with_rows(R, [&](auto r) {
            q4panel<decltype(r)::value>(wp + p * G * Q4_GBYTES, dp + p * G * 16, mp + p * G * 16, G, xq.data() + m * KP,
                                        KP, xsum.data() + m * G, xa.data() + m, yp + m * N + p * Q4_PANEL, N, valid);
          });
        });
      }
    });
  }
  if (bias.has_value() && bias->defined()) y.add_(*bias);
  return y;
}

// exp(x) for x <= 0 on 8 lanes (Cephes' expf: x = k ln2 + r with ln2 in two parts, a degree-6
// polynomial in r, times 2^k; within 2 ulp of std::exp). The scalar std::exp per score was most of a
// 5-row verify's attention time. Every lane computes the same function, so a score's exp depends only
// on its own value.
#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));  // below: the result underflows to 0 anyway
  const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

// p[j] = exp(p[j] - mx) for j < n; returns their sum, added in a fixed order for a given n.
static inline float exp_shifted_sum(float* p, int64_t n, float mx) {
  int64_t j = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + j), m));
    _mm256_storeu_ps(p + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  if (j < n) {  // the last few through the same lanes; the padding lanes are zeroed
    alignas(32) float tail[8];
    alignas(32) int32_t keep[8];
    for (int i = 0; i < 8; ++i) {
      tail[i] = j + i < n ? p[j + i] - mx : 0.f;
      keep[i] = j + i < n ? -1 : 0;
    }
    const __m256 e = _mm256_and_ps(exp_nonpositive(_mm256_load_ps(tail)),
                                   _mm256_castsi256_ps(_mm256_load_si256(reinterpret_cast<const __m256i*>(keep))));
    _mm256_store_ps(tail, e);
    for (int i = 0; j + i < n; ++i) p[j + i] = tail[i];
    acc = _mm256_add_ps(acc, e);
    j = n;
  }
  sum = hsum8(acc);
#endif
  for (; j < n; ++j) {
    p[j] = std::exp(p[j] - mx);
    sum += p[j];
  }
  return sum;
}

// The scaled scores q . k of U keys (cache slots slots[0..U-1] of the head's keys kg): each key's
// dot product is one chain of FMAs in d order, whatever U is; U of them in flight at once.
template <int U>
static inline void scores(const float* qh, const float* kg, const int32_t* slots, int64_t D, float sc, float* out) {
  const float* kr[U];
  vec a[U];
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u) kr[u] = kg + slots[u] * D, a[u] = vzero();
  int64_t d = 0;
  for (; d + VL <= D; d += VL) {
    const vec qv = vload(qh + d);
#pragma GCC unroll 8
    for (int u = 0; u < U; ++u) a[u] = vfma(qv, vload(kr[u] + d), a[u]);
  }
  float s[U];
#pragma GCC unroll 8
  for (int u = 0; u < U; ++u) s[u] = vsum(a[u]);  // the vectors' sums before the tail's scalar FMAs
  for (int u = 0; u < U; ++u) {
    for (int64_t e = d; e < D; ++e) s[u] = __builtin_fmaf(qh[e], kr[u][e], s[u]);
    out[u] = s[u] * sc;
  }
}

// One block of NV vectors of d (d0 .. d0 + NV*VL - 1) for HN heads. NV and HN are compile-time
// counts so that the HN*NV accumulators stay in registers: with a run-time count the compiler kept
// them on the stack, and every FMA went through a store and a reload (most of a 16-row verify's
// attention time). Each accumulator is the same chain of FMAs in key order either way.
template <int HN, int NV>
static inline void weighted_block(const float* p, int64_t ldp, const float* vg, const int32_t* slots, int64_t n,
                                  int64_t D, int64_t d0, float* acc) {
  vec a[HN][NV];
  for (int h = 0; h < HN; ++h)
    for (int u = 0; u < NV; ++u) a[h][u] = vzero();
  for (int64_t jj = 0; jj < n; ++jj) {
    const float* vr = vg + slots[jj] * D + d0;
    vec w[HN];
    for (int h = 0; h < HN; ++h) w[h] = vset1(p[h * ldp + jj]);
    for (int u = 0; u < NV; ++u) {
      const vec x = vload(vr + u * VL);
      for (int h = 0; h < HN; ++h) a[h][u] = vfma(w[h], x, a[h][u]);
    }
  }
  for (int h = 0; h < HN; ++h)
    for (int u = 0; u < NV; ++u) vstore(acc + h * D + d0 + u * VL, a[h][u]);
}

// The weighted values of HN heads that share a value head: acc[h * D + d] = sum over the keys
// jj < n, in slot order, of p[h * ldp + jj] * v[slots[jj]][d]. Each output element's sum is one chain
// of FMAs in key order whatever HN is; HN heads per pass read each value row once from memory
// (the other heads find it in L1), with up to 8 vectors of d per head in registers.
#if VL == 16
#define HEADS_AT_ONCE 3  // 3 heads x 8 accumulators, 3 weights and a value vector of 32 AVX-512 registers
#else
#define HEADS_AT_ONCE 1  // 8 accumulators of 16 AVX2 registers
#endif
template <int HN>
static inline void weighted_values(const float* p, int64_t ldp, const float* vg, const int32_t* slots, int64_t n,
                                   int64_t D, float* acc) {
  int64_t d0 = 0;
  for (; d0 + 8 * VL <= D; d0 += 8 * VL) weighted_block<HN, 8>(p, ldp, vg, slots, n, D, d0, acc);
  if (d0 + VL <= D) {
    const int64_t nv = (D - d0) / VL;  // 1..7
    with_rows<7>(nv, [&](auto c) { weighted_block<HN, decltype(c)::value>(p, ldp, vg, slots, n, D, d0, acc); });
    d0 += nv * VL;
  }
  for (int h = 0; h < HN; ++h)
    for (int64_t d = d0; d < D; ++d) {  // a head size that is not a multiple of the vector width
      float a = 0.f;
      for (int64_t jj = 0; jj < n; ++jj) a = __builtin_fmaf(p[h * ldp + jj], vg[slots[jj] * D + d], a);
      acc[h * D + d] = a;
    }
}

// The largest of p[0..n-1] (a NaN is skipped, as std::max(mx, x) skips it). A max is exact, so
// the lanes' order does not change it; the scalar chain was a tenth of the attention's time.
static inline float max_of(const float* p, int64_t n) {
  int64_t j = 0;
  float mx = -INFINITY;
  vec m = vset1(-INFINITY);
  for (; j + VL <= n; j += VL) m = vmax(vload(p + j), m);  // a NaN score keeps m
  alignas(64) float lanes[VL];
  vstore(lanes, m);
  for (int i = 0; i < VL; ++i) mx = std::max(mx, lanes[i]);
  for (; j < n; ++j) mx = std::max(mx, p[j]);
  return mx;
}

template <class F>
static inline void with_heads(int64_t hn, const F& f) {
  switch (hn) {
#if HEADS_AT_ONCE >= 3
    case 3: f(std::integral_constant<int, 3>{}); break;
#endif
#if HEADS_AT_ONCE >= 2
    case 2: f(std::integral_constant<int, 2>{}); break;
#endif
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

// ---- Attention for a step's query rows: each (sequence, query row, head) over exactly the key
// slots its own mask row allows, in slot order, with fixed-order sums. Nothing in a row's result
// depends on the other rows of the batch or on how many key slots the batch spans, so row i of a
// verify equals the one-token step at that position bit for bit (SDPA and batched matmuls reduce
// over the batch's longest extent, with a lane split that changes with it).
// q [B, T, H, D]; k, v [B, Hkv, S, D]; mask [B, T, S] bool (true = attend). Returns [B, T, H, D].
// A row that may attend to nothing (a padding row of a batch bucket) gives zeros.
torch::Tensor rowdot_attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor mask, double scaling) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && mask.dim() == 3, "shape mismatch");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat, "fp32 only");
  TORCH_CHECK(mask.scalar_type() == at::kBool, "boolean mask");
  q = q.contiguous(); k = k.contiguous(); v = v.contiguous(); mask = mask.contiguous();
  const int64_t B = q.size(0), T = q.size(1), H = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), S = k.size(2);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D && H % Hkv == 0 && mask.size(0) == B && mask.size(1) == T &&
              mask.size(2) == S, "shape mismatch");
  const int64_t rep = H / Hkv;
  auto out = torch::empty({B, T, H, D}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  const bool* mp = mask.data_ptr<bool>();
  float* op = out.data_ptr<float>();
  const float sc = float(scaling);
  at::parallel_for(0, B * T * Hkv, 1, [&](int64_t i0, int64_t i1) {
    std::vector<int32_t> slots(S);
    std::vector<float> p(S * rep), sums(rep);
    std::vector<float> acc(HEADS_AT_ONCE * D);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / (T * Hkv), t = (i / Hkv) % T, g = i % Hkv;
      const bool* m = mp + (b * T + t) * S;
      int64_t n = 0;
      for (int64_t s = 0; s < S; ++s)
        if (m[s]) slots[n++] = int32_t(s);
      const float* kg = kp + (b * Hkv + g) * S * D;
      const float* vg = vp + (b * Hkv + g) * S * D;
      float* pg = p.data();  // [rep, S]: the scores, then the weights, of each query head of group g
      const float* qg = qp + ((b * T + t) * H + g * rep) * D;
      float* og = op + ((b * T + t) * H + g * rep) * D;
      if (n == 0) {
        std::fill(og, og + rep * D, 0.f);
        continue;
      }
      // Scores, eight keys at a time (eight chains in flight: with four the FMAs' latency bound
      // the loop), the same keys for every head of the group while they are in L1.
      int64_t j = 0;
      for (; j + 8 <= n; j += 8)
        for (int64_t h = 0; h < rep; ++h) scores<8>(qg + h * D, kg, slots.data() + j, D, sc, pg + h * S + j);
      for (; j + 4 <= n; j += 4)
        for (int64_t h = 0; h < rep; ++h) scores<4>(qg + h * D, kg, slots.data() + j, D, sc, pg + h * S + j);
      for (; j < n; ++j)
        for (int64_t h = 0; h < rep; ++h) scores<1>(qg + h * D, kg, slots.data() + j, D, sc, pg + h * S + j);
      for (int64_t h = 0; h < rep; ++h) {
        float* ph = pg + h * S;
        sums[h] = exp_shifted_sum(ph, n, max_of(ph, n));
      }
      // Weighted values, for up to HEADS_AT_ONCE heads per pass over the values.
      for (int64_t h = 0; h < rep; h += HEADS_AT_ONCE) {
        const int64_t hn = std::min<int64_t>(HEADS_AT_ONCE, rep - h);
        with_heads(hn, [&](auto c) {
          weighted_values<decltype(c)::value>(pg + h * S, S, vg, slots.data(), n, D, acc.data());
        });
        for (int64_t hh = 0; hh < hn; ++hh) {
          const float inv = 1.f / sums[h + hh];
          float* o = og + (h + hh) * D;
          for (int64_t d = 0; d < D; ++d) o[d] = acc[hh * D + d] * inv;
        }
      }
    }
  });
  return out;
}

// ---- The rest of a decoder layer, for serving/engine/decoder.py: a few torch ops each in the
// Hugging Face modules, one call each here. Every row is computed on its own, in a fixed order.

// RMSNorm of each row of x [M, H]: w * x / sqrt(mean(x^2) + eps).
torch::Tensor rowdot_rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 1 && x.size(1) == w.size(0), "shape mismatch");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "fp32 only");
  x = x.contiguous();
  w = w.contiguous();
  const int64_t M = x.size(0), H = x.size(1);
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* xr = xp + m * H;
      vec a = vzero();
      int64_t h = 0;
      for (; h + VL <= H; h += VL) a = vfma(vload(xr + h), vload(xr + h), a);
      float ss = vsum(a);
      for (; h < H; ++h) ss = __builtin_fmaf(xr[h], xr[h], ss);
      const float r = 1.f / std::sqrt(ss / float(H) + float(eps));
      for (h = 0; h < H; ++h) yp[m * H + h] = wp[h] * (xr[h] * r);
    }
  });
  return y;
}

// Rotary position embedding (the rotate-half form) on a step's fresh projections, and the keys and
// values written into the cache at each row's position. qkv [B, T, (H + 2 Hkv) D] (q, k, v heads
// in that order, as one fused projection returns them); cos, sin [B, T, D]; positions [B, T];
// kcache, vcache [>= B, Hkv, S, D], written in place. Returns the rotated queries [B, T, H, D].
torch::Tensor rowdot_rope_write(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor positions,
                                torch::Tensor kcache, torch::Tensor vcache, int64_t H, int64_t Hkv) {
  TORCH_CHECK(qkv.dim() == 3 && cos.dim() == 3 && cos.sizes() == sin.sizes() && kcache.dim() == 4 &&
              kcache.sizes() == vcache.sizes(), "shape mismatch");
  TORCH_CHECK(kcache.is_contiguous() && vcache.is_contiguous(), "the cache must be contiguous");
  TORCH_CHECK(positions.scalar_type() == at::kLong, "positions must be int64");
  qkv = qkv.contiguous(); cos = cos.contiguous(); sin = sin.contiguous(); positions = positions.contiguous();
  const int64_t B = qkv.size(0), T = qkv.size(1), D = cos.size(2), S = kcache.size(2), half = D / 2;
  TORCH_CHECK(qkv.size(2) == (H + 2 * Hkv) * D && kcache.size(1) == Hkv && kcache.size(3) == D && kcache.size(0) >= B &&
              cos.size(0) == B && cos.size(1) == T && D % 2 == 0, "shape mismatch");
  TORCH_CHECK(positions.numel() == B * T, "positions must be [B, T]");
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * T; ++i) TORCH_CHECK(pp[i] >= 0 && pp[i] < S, "position ", pp[i], " outside the cache (", S, " slots)");
  auto q = torch::empty({B, T, H, D}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* qp = q.data_ptr<float>();
  float* kc = kcache.data_ptr<float>();
  float* vc = vcache.data_ptr<float>();
  const int64_t W = (H + 2 * Hkv) * D;
  auto rope = [&](const float* x, const float* c, const float* s, float* out) {
    for (int64_t d = 0; d < half; ++d) out[d] = x[d] * c[d] - x[d + half] * s[d];
    for (int64_t d = half; d < D; ++d) out[d] = x[d] * c[d] + x[d - half] * s[d];
  };
  // Over sequences, a sequence's tokens in order: a finished row's tokens may share one slot, and
  // the last write must win the same way every time.
  at::parallel_for(0, B, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t i = b0 * T; i < b1 * T; ++i) {
      const int64_t b = i / T, pos = pp[i];
      const float* x = xp + i * W;
      const float* c = cp + i * D;
      const float* s = sp + i * D;
      for (int64_t h = 0; h < H; ++h) rope(x + h * D, c, s, qp + (i * H + h) * D);
      for (int64_t g = 0; g < Hkv; ++g) {
        const int64_t slot = ((b * Hkv + g) * S + pos) * D;
        rope(x + (H + g) * D, c, s, kc + slot);
        std::copy(x + (H + Hkv + g) * D, x + (H + Hkv + g + 1) * D, vc + slot);
      }
    }
  });
  return q;
}

// SiLU(gate) * up for each row of gu [M, 2I] (gate in the first I columns, up in the rest), one
// row at a time with the same per-element arithmetic wherever an element falls: torch's SiLU
// switches between a vector and a scalar exp at the ends of the blocks it splits a tensor into, so
// an element's last bit depended on how many rows ran together. silu(g) = g / (1 + e^-g), taken as
// g / (1 + e) for g >= 0 and g e / (1 + e) for g < 0, e = exp(-|g|), so exp only sees x <= 0.
torch::Tensor rowdot_silu_mul(torch::Tensor gu, int64_t I) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) == 2 * I && gu.scalar_type() == at::kFloat, "gu must be fp32 [M, 2I]");
  gu = gu.contiguous();
  const int64_t M = gu.size(0);
  auto y = torch::empty({M, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const float* g = gp + m * 2 * I;
      const float* u = g + I;
      float* o = yp + m * I;
      int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
      const __m256 sign = _mm256_set1_ps(-0.f), one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
      auto silu8 = [&](__m256 gv) {
        const __m256 e = exp_nonpositive(_mm256_or_ps(gv, sign));  // exp(-|g|)
        const __m256 num = _mm256_blendv_ps(gv, _mm256_mul_ps(gv, e), _mm256_cmp_ps(gv, zero, _CMP_LT_OQ));
        return _mm256_div_ps(num, _mm256_add_ps(one, e));
      };
      for (; i + 8 <= I; i += 8) _mm256_storeu_ps(o + i, _mm256_mul_ps(silu8(_mm256_loadu_ps(g + i)), _mm256_loadu_ps(u + i)));
      if (i < I) {  // the last few through the same lanes
        alignas(32) float gt[8] = {0.f}, ut[8] = {0.f}, ot[8];
        for (int64_t k = i; k < I; ++k) gt[k - i] = g[k], ut[k - i] = u[k];
        _mm256_store_ps(ot, _mm256_mul_ps(silu8(_mm256_load_ps(gt)), _mm256_load_ps(ut)));
        for (int64_t k = i; k < I; ++k) o[k] = ot[k - i];
        i = I;
      }
#endif
      for (; i < I; ++i) {
        const float e = std::exp(-std::fabs(g[i]));
        o[i] = (g[i] < 0.f ? g[i] * e : g[i]) / (1.f + e) * u[i];
      }
    }
  });
  return y;
}
