"""Batch-invariant fp32 kernels that make verifying K+1 tokens on a CPU cost about one token.

`prepare_for_cpu(model)` swaps every `nn.Linear` (lm_head included) for `InvariantLinear`, a small
C++ kernel ("rowdot", built on first use and cached), and, for Hugging Face models, the attention
for a row-wise SDPA. Afterwards row i of an N-token forward is bitwise equal to the 1-token forward
of the same token on the same cache, so greedy speculative output equals the target alone.
`weights="int8"` stores a draft as W8A8 int8 (`Int8Linear`, AVX-512 VNNI dot products). Invariance
holds for steps of at most `max_rows` tokens (default 16); longer inputs (the prefill) use plain
F.linear / SDPA. Inference only: with autograd needed, the modules fall back to F.linear.

Why, the alternatives tried and their measurements: docs/architecture.md, "CPU kernels".
"""

from __future__ import annotations

import functools
import hashlib
import logging
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

KERNELS = ("auto", "rowdot", "mkl")
WEIGHTS = ("fp32", "int8")
ATTN_NAME = "choral_rowwise_sdpa"

_CPP = r"""
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
"""


@functools.lru_cache(maxsize=None)
def _rowdot_ext():
    """Build (or load the cached build of) the kernel; None where that is not possible."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    try:
        from torch.utils.cpp_extension import load_inline

        # -march=native code must not be reused on another CPU sharing the same cache folder.
        flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
        tag = hashlib.sha256((_CPP + flags + torch.__version__).encode()).hexdigest()[:12]
        return load_inline(
            name=f"choral_rowdot_{tag}", cpp_sources=_CPP, functions=["rowdot_linear", "rowdot_linear_w8a8"],
            extra_cflags=["-O3", "-march=native", "-fno-fast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"], verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers: fall back, say why
        log.warning("choral: building the rowdot CPU kernel failed (%s); using MKL packed sgemm", exc)
        return None


def rowdot_available() -> bool:
    """Whether the C++ kernel (fp32 rowdot and the int8 draft kernel) builds on this machine."""
    return _rowdot_ext() is not None


class InvariantLinear(nn.Module):
    """Drop-in for nn.Linear whose rows do not depend on how many rows run together.

    `weight`/`bias` are the original Parameters (tied weights and state_dict keys unchanged).
    The "mkl" kernel additionally holds an opaque MKL-packed copy of the weight (~1.2x its size).
    """

    def __init__(self, linear: nn.Linear, kernel: str, max_rows: int, pack_rows: int):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.kernel, self.max_rows, self.enabled = kernel, max_rows, True
        if kernel == "mkl":
            # Pack for >= 2 rows: a batch_size=1 pack is not used for other row counts.
            self._packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight.detach().contiguous(), pack_rows)
            # _mkl_linear reads only the output size from the original weight when the row
            # count equals batch_size, which it always does here.
            self._shape_only = torch.zeros((), dtype=torch.float32).expand(self.out_features, self.in_features)

    def select_rows(self, ids: torch.Tensor) -> "InvariantLinear":
        """The same layer computing only output rows ``ids`` (a reduced draft vocabulary)."""
        sub = nn.Linear(self.in_features, len(ids), bias=self.bias is not None, device=self.weight.device)
        sub.weight = nn.Parameter(self.weight.detach().index_select(0, ids).contiguous(), requires_grad=False)
        if self.bias is not None:
            sub.bias = nn.Parameter(self.bias.detach().index_select(0, ids), requires_grad=False)
        return InvariantLinear(sub, self.kernel, self.max_rows, pack_rows=max(2, self.max_rows))

    def extra_bytes(self) -> int:
        packed = getattr(self, "_packed", None)
        return 0 if packed is None else packed.numel() * packed.element_size()

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, kernel={self.kernel}, max_rows={self.max_rows}")

    def _fast_ok(self, x: torch.Tensor) -> bool:
        return (self.enabled and x.dtype == torch.float32 and self.weight.dtype == torch.float32
                and x.device.type == "cpu" and self.weight.is_contiguous()
                and 0 < x.numel() // self.in_features <= self.max_rows
                and not (torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self._fast_ok(x):
            return F.linear(x, self.weight, self.bias)
        x2 = x.reshape(-1, self.in_features)
        bias = None if self.bias is None else self.bias.detach()
        if self.kernel == "rowdot":
            y = _rowdot_ext().rowdot_linear(x2, self.weight.detach(), bias)
        elif x2.shape[0] == 1:
            # MKL rounds a lone row differently for small layers (<= ~128 wide); as a row of two it
            # takes the same path as every other row count.
            y = torch.ops.mkl._mkl_linear(x2.expand(2, -1), self._packed, self._shape_only, bias, 2)[:1]
        else:
            y = torch.ops.mkl._mkl_linear(x2, self._packed, self._shape_only, bias, x2.shape[0])
        return y.view(*x.shape[:-1], self.out_features)


class Int8Linear(nn.Module):
    """int8 Linear for drafts (W8A8): each weight row is int8 with one fp32 scale (symmetric,
    absmax / 127), each input row is quantized the same way when it arrives, and the C++ kernel
    multiplies them with VNNI's integer dot products. A draft step reads a quarter of the fp32
    bytes and does next to no float work, so it runs near the memory-bandwidth limit.

    For drafts only: int8 changes a model's numerics, so a target's greedy output would no
    longer be the fp32 model's. A draft's numerics only decide how often its proposals are
    accepted; the target's verification keeps the output exact whatever the draft computes.
    Integer sums are exact, so rows are batch-invariant anyway. Steps longer than ``max_rows``
    (prefill) run F.linear on the dequantized weights.
    """

    def __init__(self, linear: nn.Linear | None, max_rows: int):
        super().__init__()
        self.max_rows = max_rows
        if linear is None:  # filled in by select_rows
            return
        w = linear.weight.detach().float()  # [N, K]
        self.out_features, self.in_features = w.shape
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [N]
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
        padded = torch.zeros(w.shape[0], -(-w.shape[1] // 64) * 64, dtype=torch.int8)  # [N, KP], KP % 64 == 0
        padded[:, : w.shape[1]] = q
        self._set(padded, scale, None if linear.bias is None else linear.bias.detach().float())

    def _set(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.register_buffer("qweight", qweight.contiguous())  # [N, KP]
        self.register_buffer("scale", scale.float().contiguous())  # [N]
        self.register_buffer("row_sums", qweight.sum(dim=1, dtype=torch.int32).contiguous())  # [N]
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)

    def select_rows(self, ids: torch.Tensor) -> "Int8Linear":
        """The same layer computing only output rows ``ids`` (a reduced draft vocabulary)."""
        sub = Int8Linear(None, self.max_rows)
        sub.in_features, sub.out_features = self.in_features, len(ids)
        bias = None if self.bias is None else self.bias.detach().index_select(0, ids)
        sub._set(self.qweight.index_select(0, ids), self.scale.index_select(0, ids), bias)
        return sub

    def dequantized(self) -> torch.Tensor:
        return self.qweight[:, : self.in_features].float() * self.scale[:, None]  # [N, K]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, w8a8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // self.in_features
        if x.dtype != torch.float32 or x.device.type != "cpu" or not 0 < rows <= self.max_rows:
            return F.linear(x, self.dequantized().to(x.dtype), self.bias)
        y = _rowdot_ext().rowdot_linear_w8a8(x.reshape(-1, self.in_features), self.qweight, self.scale,
                                             self.row_sums, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def _rowwise_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
    """SDPA one query row at a time, each over exactly the keys that row may attend to."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len = query.shape[2]
    if attention_mask is None or attention_mask.dtype != torch.bool or q_len > _rowwise_sdpa.max_rows:
        # No mask: a 1-token step on a dynamic cache (already canonical) or a causal prefill.
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    allowed = attention_mask.any(dim=1)  # [batch, q, kv]
    kv = allowed.shape[-1]
    pos = torch.arange(1, kv + 1, device=allowed.device)
    lengths = (allowed.any(dim=0) * pos).amax(dim=-1)  # keys up to the last allowed one
    full = (allowed.sum(dim=-1) == lengths).all(dim=0)  # nothing masked inside that range
    outs = []
    for i, (n, dense) in enumerate(zip(lengths.tolist(), full.tolist())):
        n = max(n, 1)
        mask = None if dense else attention_mask[:, :, i : i + 1, :n]
        out, _ = sdpa_attention_forward(module, query[:, :, i : i + 1], key[:, :, :n], value[:, :, :n],
                                        mask, *args, **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1), None


# Module-level because the attention interface is a global registry keyed by name; the
# latest prepare_for_cpu call sets it.
_rowwise_sdpa.max_rows = 16


def _use_rowwise_attention(model: nn.Module) -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, _rowwise_sdpa)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    if model.config._attn_implementation != ATTN_NAME:
        model._choral_attn_before = model.config._attn_implementation
    model.set_attn_implementation(ATTN_NAME)


def _check_invariance(mod: nn.Module, counts: Sequence[int]) -> bool:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(max(counts), mod.in_features, generator=g)
    with torch.no_grad():
        full = mod(x)
        return all(torch.equal(mod(x[i : i + 1]), full[i : i + 1]) for i in range(x.shape[0])) and all(
            torch.equal(mod(x[:n]), full[:n]) for n in counts)


def prepare_for_cpu(
    model: nn.Module,
    *,
    token_counts: Sequence[int] = (1, 5),
    kernel: str = "auto",
    max_rows: int = 16,
    attention: bool = True,
    weights: str = "fp32",
    own_tensors: bool = True,
) -> nn.Module:
    """Make the forward of `model` batch-invariant and cheap for small token counts, in place.

    token_counts: the step sizes that must agree with each other (checked on every distinct
      Linear shape; a shape that fails falls back to F.linear with a warning).
    kernel: "rowdot" (the C++ kernel), "mkl" (packed sgemm, no compiler needed) or "auto".
    max_rows: steps longer than this (prefill) use the library kernels.
    attention: also switch a Hugging Face model to the row-wise SDPA.
    weights: "fp32" keeps the model's numerics (for the target); "int8" stores every Linear as
      W8A8 int8 (`Int8Linear`, needs the C++ kernel): ~2.4x cheaper steps, different numerics,
      so for drafts only, whose numerics never change the speculative output.
    own_tensors: with int8, give the tensors kept in fp32 storage of their own (``_own_tensors``);
      False for a copy that shares them with a model that keeps its mapping anyway (train-draft's
      evaluation of the student it is training: a clone would be 0.5 GB for nothing).
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if weights == "int8" and _rowdot_ext() is None:
        raise RuntimeError("int8 draft weights need the rowdot C++ kernel, which could not be built here; "
                           "use draft_weights=fp32")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel in ("auto", "rowdot") and _rowdot_ext() is None:
        if kernel == "rowdot":
            raise RuntimeError("the rowdot kernel could not be built on this machine")
        kernel = "mkl"
    elif kernel == "auto":
        kernel = "rowdot"
    counts = sorted({1, *token_counts})
    if max(counts) > max_rows:
        raise ValueError(f"token_counts {counts} exceed max_rows={max_rows}")
    model.eval().requires_grad_(False)
    checked: dict[tuple, bool] = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child.weight.dtype != torch.float32:
                continue
            if weights == "int8":
                new = Int8Linear(child, max_rows)
            else:
                new = InvariantLinear(child, kernel, max_rows, pack_rows=max(2, counts[-1]))
            key = (child.out_features, child.in_features, child.bias is not None)
            if key not in checked:
                checked[key] = _check_invariance(new, counts)
                if not checked[key]:
                    log.warning("choral: %s kernel not batch-invariant for Linear%s; using F.linear", kernel, key)
            if checked[key]:
                setattr(parent, name, new)
    if weights == "int8" and own_tensors:
        _own_tensors(model)
    if attention and hasattr(model, "set_attn_implementation"):
        _rowwise_sdpa.max_rows = max_rows
        _use_rowwise_attention(model)
    return model


@torch.no_grad()
def _own_tensors(model: nn.Module) -> None:
    """Give the tensors an int8 draft keeps in fp32 (embeddings, norms) storage of their own.
    Models load memory-mapped from their safetensors file, and every page the int8 conversion read
    counts as resident for as long as any tensor still points into that mapping: 1.4 GB of a 0.5B
    draft's 2.5 GB file stayed resident through its fp32 embedding alone. Owning the few kept
    tensors releases the mapping."""
    for t in (*model.parameters(), *model.buffers()):
        t.data = t.data.clone()


def set_enabled(model: nn.Module, enabled: bool) -> None:
    """Switch a prepared model between its invariant kernels and the stock ones (for A/B)."""
    for m in model.modules():
        if isinstance(m, InvariantLinear):
            m.enabled = enabled
    before = getattr(model, "_choral_attn_before", None)
    if before is not None:
        model.set_attn_implementation(ATTN_NAME if enabled else before)
