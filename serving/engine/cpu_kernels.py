"""Batch-invariant fp32 kernels that make verifying K+1 tokens on a CPU cost about one token.

`prepare_for_cpu(model)` swaps every `nn.Linear` (lm_head included) for `InvariantLinear`, a small
C++ kernel ("rowdot", the source is `rowdot.cpp` next to this file, built on first use and cached),
and, for Hugging Face models, the attention for a row-wise SDPA. Afterwards row i of an N-token
forward is bitwise equal to the 1-token forward of the same token on the same cache, so greedy
speculative output equals the target alone. `weights="int8"` stores a model as W8A8 int8
(`Int8Linear`, VNNI integer dot products; AVX2 where there is no VNNI): a draft, or a target whose
output is then the int8 target's. `weights="q4"` keeps a GGUF's 4-bit tensors in their own 4-bit
groups (`Q4Linear`, W4A8) and the rest in int8. fp32 invariance holds for steps of at most
`max_rows` tokens per sequence (default 16), however many sequences run together; longer inputs
(the prefill) use plain F.linear / SDPA. The integer kernels are invariant at any length, so
they run the prefill too. Inference only: with autograd needed, the modules fall back to F.linear.

Why, the alternatives tried and their measurements: docs/architecture.md, "CPU kernels".
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import time
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from serving.engine import weights_cache
from serving.engine.decoder import LeanDecoder
from serving.engine.devices import resolve_dtype

log = logging.getLogger(__name__)

KERNELS = ("auto", "rowdot", "mkl")
WEIGHTS = ("fp32", "int8", "q4")
ATTN_NAME = "choral_rowwise_sdpa"
# The C++ source of the kernels, shipped as package data next to this module (pyproject.toml).
ROWDOT_SOURCE = Path(__file__).with_name("rowdot.cpp")


REQUIRE_KERNELS = "CHORAL_REQUIRE_KERNELS"  # "1": a kernel that cannot be built is an error, not a fallback (CI sets it)


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be built where they were required (``CHORAL_REQUIRE_KERNELS=1``)."""


@functools.lru_cache(maxsize=None)
def _rowdot_ext():
    """Build (or load the cached build of) the kernel; None where that is not possible, unless
    ``CHORAL_REQUIRE_KERNELS=1``, where it raises ``KernelBuildError`` with the compiler's error."""
    required = os.environ.get(REQUIRE_KERNELS) == "1"
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in ("AVX2", "AVX512"):
        if required:
            raise KernelBuildError(f"{REQUIRE_KERNELS}=1 but this CPU's capability is {capability}: the kernels need "
                                   "AVX2 or AVX-512 (unset it to run on the fallback)")  # fmt: skip
        return None
    try:
        from torch.utils.cpp_extension import get_default_build_root, load_inline

        source = ROWDOT_SOURCE.read_text()
        # -march=native code must not be reused on another CPU sharing the same cache folder.
        flags = next((ln for ln in open("/proc/cpuinfo") if ln.startswith("flags")), "")
        tag = hashlib.sha256((source + flags + torch.__version__).encode()).hexdigest()[:12]
        clear_stale_lock(Path(get_default_build_root()) / f"choral_rowdot_{tag}")
        return load_inline(
            name=f"choral_rowdot_{tag}", cpp_sources=source, functions=["rowdot_linear", "rowdot_linear_w8a8", "rowdot_linear_w4a8", "rowdot_attention", "rowdot_rms_norm", "rowdot_rope_write", "rowdot_silu_mul", "rowdot_amx"],
            extra_cflags=["-O3", "-march=native", "-fno-fast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"], verbose=False,
        )
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers: fall back, say why
        if required:
            raise KernelBuildError(f"building the rowdot CPU kernel ({ROWDOT_SOURCE}) failed and {REQUIRE_KERNELS}=1: "
                                   f"{exc}") from exc  # fmt: skip
        log.warning("choral: building the rowdot CPU kernel failed (%s); using MKL packed sgemm", exc)
        return None


STALE_LOCK_S = 900.0  # a kernel build takes a minute or two on 2 cores; a lock this old has no builder left


def clear_stale_lock(build_dir: Path, now: float | None = None) -> bool:
    """Remove the build folder's ``lock`` when it is older than ``STALE_LOCK_S``: torch's build
    lock holds no process id, and a process killed while building (a cancelled CI run) left one
    that made every later process wait on it forever. Returns whether it removed one."""
    lock = build_dir / "lock"
    try:
        age = (time.time() if now is None else now) - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < STALE_LOCK_S:
        return False
    log.warning("choral: removing a stale kernel build lock (%s, %.0f s old: its builder is gone)", lock, age)
    lock.unlink(missing_ok=True)
    return True


def rowdot_available() -> bool:
    """Whether the C++ kernel (fp32 rowdot and the int8 draft kernel) builds on this machine."""
    return _rowdot_ext() is not None


def step_tokens(x: torch.Tensor, in_features: int) -> int:
    """Tokens per sequence of a Linear's input: ``x.shape[-2]`` of a [B, T, D] step (a batch of
    short steps is still a step; the kernels' rows are invariant to how many run together), every
    row of a 2-D input. What ``max_rows`` is compared with, to tell a step from a prefill."""
    return x.shape[-2] if x.dim() >= 3 else x.numel() // in_features


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
                and 0 < step_tokens(x, self.in_features) <= self.max_rows
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
    multiplies them with exact integer dot products (VNNI's ``vpdpbusd``, or ``vpmaddubsw`` on
    AVX2). A step reads a quarter of the fp32 bytes and does next to no float work.

    int8 changes a model's numerics. A draft's numerics only decide how often its proposals are
    accepted; the target's verification keeps the output exact whatever the draft computes. A
    target in int8 (``target_weights=int8``) gives the int8 target's output, no longer the fp32
    model's. Integer sums are exact and each input row is scaled on its own, so rows are
    batch-invariant: speculative output equals that int8 target's own greedy output. Steps of
    any number of tokens, a prefill too, run on the same kernel (integer sums do not depend on how
    the rows are grouped).
    """

    def __init__(self, linear: nn.Linear | None):
        super().__init__()
        if linear is None:  # filled in by select_rows
            return
        w = linear.weight.detach().float()  # [N, K]
        self.out_features, self.in_features = w.shape
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0  # [N]
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
        padded = torch.zeros(w.shape[0], -(-w.shape[1] // 64) * 64, dtype=torch.int8)  # [N, KP], KP % 64 == 0
        padded[:, : w.shape[1]] = q
        self._set(padded, scale, None if linear.bias is None else linear.bias.detach().float())

    def _set(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
             row_sums: torch.Tensor | None = None) -> None:
        self.register_buffer("qweight", qweight.contiguous())  # [N, KP]
        self.register_buffer("scale", scale.float().contiguous())  # [N]
        if row_sums is None:
            row_sums = qweight.sum(dim=1, dtype=torch.int32)
        self.register_buffer("row_sums", row_sums.contiguous())  # [N] int32
        self.bias = None if bias is None else nn.Parameter(bias.clone(), requires_grad=False)

    @classmethod
    def from_buffers(cls, in_features: int, qweight: torch.Tensor, scale: torch.Tensor,
                     bias: torch.Tensor | None, row_sums: torch.Tensor | None = None) -> "Int8Linear":
        """A layer from stored buffers (``serving.engine.weights_cache``); ``row_sums`` as stored
        (summing 0.7 GB of int8 rows again took over a second of every start)."""
        mod = cls(None)
        mod.in_features, mod.out_features = in_features, qweight.shape[0]
        if row_sums is not None and (row_sums.dtype != torch.int32 or row_sums.shape != qweight.shape[:1]):
            raise ValueError(f"row_sums {tuple(row_sums.shape)} {row_sums.dtype}: expected ({qweight.shape[0]},) int32")
        mod._set(qweight, scale, bias, row_sums)
        return mod

    def select_rows(self, ids: torch.Tensor) -> "Int8Linear":
        """The same layer computing only output rows ``ids`` (a reduced draft vocabulary)."""
        sub = Int8Linear(None)
        sub.in_features, sub.out_features = self.in_features, len(ids)
        bias = None if self.bias is None else self.bias.detach().index_select(0, ids)
        sub._set(self.qweight.index_select(0, ids), self.scale.index_select(0, ids), bias)
        return sub

    def dequantized(self) -> torch.Tensor:
        return self.qweight[:, : self.in_features].float() * self.scale[:, None]  # [N, K]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, w8a8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _low_bit_ok(x):
            return F.linear(x, self.dequantized().to(x.dtype), self.bias)
        y = _rowdot_ext().rowdot_linear_w8a8(x.reshape(-1, self.in_features), self.qweight, self.scale,
                                             self.row_sums, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def _low_bit_ok(x: torch.Tensor) -> bool:
    """Whether the integer kernels take this input: any number of rows (a prefill too, since
    integer sums do not depend on how rows are grouped), fp32 on the CPU, no autograd."""
    return x.dtype == torch.float32 and x.device.type == "cpu" and x.numel() > 0 and not (
        torch.is_grad_enabled() and x.requires_grad)


Q4_GROUP = 32
Q4_PANEL = 16  # outputs per panel in the kernel's layout (rowdot.cpp)


def q4_lattice(w: torch.Tensor, tol: float = 1e-3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``w`` [N, K] as 4-bit groups of 32 along K, if it already lies on such a lattice: for every
    group a step d and minimum m with every weight = d * q + m, q an integer in 0..15 (to ``tol``
    of d). A GGUF Q4_K tensor dequantized to fp32 is exactly that (its 32-weight sub-blocks have a
    scale and a minimum each), so its blocks are recovered rather than requantized; a Q6_K tensor
    or a float model's weights are not, and get None. Returns q [N, K] uint8, d and m [N, K/32]."""
    k = w.shape[1]
    if k % Q4_GROUP:
        return None
    qs, ds, ms = [], [], []
    for rows in w.detach().split(2048):  # bounded temporaries for a 150k-row head
        got = _q4_lattice_rows(rows.float().reshape(rows.shape[0], k // Q4_GROUP, Q4_GROUP), tol)
        if got is None:
            return None
        qs.append(got[0].reshape(rows.shape[0], k))
        ds.append(got[1])
        ms.append(got[2])
    return torch.cat(qs), torch.cat(ds), torch.cat(ms)


def q4_requantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """``w`` [N, K] rounded into 4-bit groups of 32 along K, as llama.cpp's Q4_1 does: per group
    the minimum m and the step d = (max - m) / 15, every weight the nearest m + d * q, q in 0..15.
    For drafts only (``prepare_for_cpu(requantize=True)``): a draft's numerics never change the
    speculative output, only how much of it is accepted, so it may be rounded where the target
    may not. Returns q [N, K] uint8, d and m [N, K/32] (``q4_lattice``'s form); None when K is not
    a multiple of 32."""
    n, k = w.shape
    if k % Q4_GROUP:
        return None
    qs, ds, ms = [], [], []
    for rows in w.detach().split(2048):  # bounded temporaries for a 150k-row head
        g = rows.float().reshape(rows.shape[0], k // Q4_GROUP, Q4_GROUP)  # [n, G, 32]
        lo = g.amin(-1, keepdim=True)
        d = (g.amax(-1, keepdim=True) - lo) / 15
        # fp16 as Q4Linear stores them, so that the levels are rounded against the stored step
        lo, d = lo.half().float(), d.half().float()
        safe = torch.where(d > 0, d, torch.ones_like(d))  # a constant group: q = 0
        qs.append(torch.round((g - lo) / safe).clamp_(0, 15).to(torch.uint8).reshape(rows.shape[0], k))
        ds.append(d.squeeze(-1))
        ms.append(lo.squeeze(-1))
    return torch.cat(qs), torch.cat(ds), torch.cat(ms)


def snap_to_q4_lattice(w: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K] (K a multiple of 32) rounded onto 4-bit groups of 32: each group's minimum plus
    an integer 0..15 times (max - min) / 15, as a GGUF Q4_K tensor dequantized to fp32 is. What
    tests and benchmarks give ``q4_lattice`` to stand in for the bundled target's weights."""
    n, k = w.shape
    g = w.reshape(n, k // Q4_GROUP, Q4_GROUP)  # [N, G, 32]
    lo = g.amin(-1, keepdim=True)
    d = (g.amax(-1, keepdim=True) - lo) / 15
    return (torch.round((g - lo) / d) * d + lo).reshape(n, k)


def _q4_lattice_rows(g: torch.Tensor, tol: float):
    lo = g.amin(dim=-1, keepdim=True)  # [n, G, 1]
    span = g.amax(dim=-1, keepdim=True) - lo
    gaps = g.sort(dim=-1).values.diff(dim=-1)  # [n, G, 31]
    gaps = torch.where(gaps > span * 1e-3, gaps, torch.full_like(gaps, float("inf")))
    step = gaps.amin(dim=-1, keepdim=True)  # the smallest distinct gap: the step, or a multiple of it
    step = torch.where(torch.isfinite(step), step, torch.ones_like(step))  # a constant group: q = 0

    def fits(x, base, d):  # x [..., 32]: is every value base + d * q, q in 0..15?
        q = torch.round((x - base) / d)
        return (q <= 15).all(dim=-1) & ((q * d + base - x).abs() <= tol * d).all(dim=-1), q

    ok, q = fits(g, lo, step)
    if ok.all():
        return q.to(torch.uint8), step.squeeze(-1), lo.squeeze(-1)
    # Groups whose levels skip neighbours (their smallest gap is a multiple of the step): try
    # every step span / j. A sample decides first, so a 6-bit tensor is turned down cheaply.
    bad = (~ok).reshape(-1).nonzero().squeeze(-1)  # flat group indices
    flat = g.reshape(-1, g.shape[-1])
    flat_lo, flat_span = lo.reshape(-1, 1), span.reshape(-1, 1)
    for idx in (bad[:256], bad):
        x, base, width = flat[idx], flat_lo[idx], flat_span[idx]
        done = torch.zeros(len(idx), dtype=torch.bool)
        d_found, q_found = torch.ones_like(width), torch.zeros_like(x)
        for j in range(15, 0, -1):
            d_j = torch.where(width > 0, width / j, torch.ones_like(width))
            ok_j, q_j = fits(x, base, d_j)
            use = ~done & ok_j
            d_found = torch.where(use[:, None], d_j, d_found)
            q_found = torch.where(use[:, None], q_j, q_found)
            done |= ok_j
        if not done.all():
            return None
    step.reshape(-1, 1)[bad] = d_found
    q.reshape(-1, q.shape[-1])[bad] = q_found
    return q.to(torch.uint8), step.squeeze(-1), lo.squeeze(-1)


class Q4Linear(nn.Module):
    """A target Linear in 4-bit groups (W4A8): each group of 32 weights along the input has a
    step d and a minimum m (the GGUF's Q4_K sub-blocks, ``q4_lattice``), each input row is int8
    with one scale, as in ``Int8Linear``. The group sums of q x input are exact integers, and each
    output adds its groups' scaled sums in one fixed order, so rows are batch-invariant and a prefill
    runs on the same kernel. A step reads 0.625 bytes per weight (4 bits + two fp16 per 32) instead
    of 1 or 4, plus the padding of the outputs to whole panels of 16."""

    def __init__(self, linear: nn.Linear | None, lattice: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None):
        super().__init__()
        if linear is None:  # filled in by from_buffers
            return
        self.out_features, self.in_features = linear.weight.shape
        q, d, m = lattice
        # Pad the outputs to panels of 16 (zero weights, steps and minimums add exact zeros; the
        # inputs are whole groups, as q4_lattice takes only those) and store each panel's group as the kernel reads it
        # (rowdot.cpp, "4-bit weights"): four 64-byte vectors v whose byte 4o + c holds output o's
        # weight 4v + c (low nibble) and 16 + 4v + c (high nibble), an AMX B tile once unpacked.
        n, k = q.shape
        np_, groups = -(-n // Q4_PANEL) * Q4_PANEL, k // Q4_GROUP
        qp = torch.zeros(np_, k, dtype=torch.uint8)
        qp[:n] = q
        qp = qp.view(np_ // Q4_PANEL, Q4_PANEL, groups, 2, 4, 4).permute(0, 2, 4, 1, 5, 3)  # [P, G, v, o, c, nibble]
        # fp16, as the GGUF's own super-block scales: a group's step and minimum then cost 4 bytes
        # per 32 weights (16 bytes of 4-bit values) instead of 8, and move each weight by at most
        # 2^-11 of its value, far inside the 4-bit rounding the file already made.
        self._set((qp[..., 0] | (qp[..., 1] << 4)).reshape(np_ // Q4_PANEL, groups * Q4_PANEL * Q4_GROUP // 2),  # [P, G*256]
                  _q4_panels(d, np_), _q4_panels(m, np_), linear.bias)  # fmt: skip

    def _set(self, qweight: torch.Tensor, step: torch.Tensor, minimum: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.register_buffer("qweight", qweight.contiguous())  # [P, G*256]
        self.register_buffer("step", step.contiguous())  # [P, G*16] fp16
        self.register_buffer("minimum", minimum.contiguous())  # [P, G*16] fp16
        self.bias = None if bias is None else nn.Parameter(bias.detach().float().clone(), requires_grad=False)

    @classmethod
    def from_buffers(cls, in_features: int, out_features: int, qweight: torch.Tensor, step: torch.Tensor,
                     minimum: torch.Tensor, bias: torch.Tensor | None) -> "Q4Linear":
        """A layer from stored buffers (``serving.engine.weights_cache``)."""
        if qweight.shape[0] != -(-out_features // Q4_PANEL):
            raise ValueError(f"{qweight.shape[0]} panels of 16 stored for {out_features} outputs")
        mod = cls(None, None)
        mod.in_features, mod.out_features = in_features, out_features
        mod._set(qweight, step, minimum, bias)
        return mod

    def lattice(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stored groups back in ``q4_lattice``'s form: q [N, K] uint8, d and m [N, K/32]
        (the fp16 values as stored, in fp32)."""
        p, groups = self.qweight.shape[0], self.step.shape[1] // Q4_PANEL
        b = self.qweight.view(p, groups, 4, Q4_PANEL, 4)  # [P, G, v, o, c]
        q = torch.stack([b & 0x0F, b >> 4], dim=-1).permute(0, 3, 1, 5, 2, 4)  # [P, o, G, nibble, v, c]
        q = q.reshape(p * Q4_PANEL, groups * Q4_GROUP)[: self.out_features, : self.in_features]

        def per_output(t):  # [P, G*16] -> [N, G]
            return t.view(p, groups, Q4_PANEL).permute(0, 2, 1).reshape(p * Q4_PANEL, groups)[: self.out_features].float()

        return q.contiguous(), per_output(self.step), per_output(self.minimum)

    def select_rows(self, ids: torch.Tensor) -> "Q4Linear":
        """The same layer computing only output rows ``ids`` (a reduced draft vocabulary), each
        row's groups as stored, so every kept output is bitwise the full layer's."""
        q, d, m = self.lattice()
        bias = None if self.bias is None else self.bias.detach().index_select(0, ids)
        shape = SimpleNamespace(weight=torch.empty(len(ids), self.in_features, device="meta"), bias=bias)
        return Q4Linear(shape, (q.index_select(0, ids), d.index_select(0, ids), m.index_select(0, ids)))

    def dequantized(self) -> torch.Tensor:
        p, groups = self.qweight.shape[0], self.step.shape[1] // Q4_PANEL
        b = self.qweight.view(p, groups, 4, Q4_PANEL, 4)  # [P, G, v, o, c]
        q = torch.stack([b & 0x0F, b >> 4], dim=-1).permute(0, 3, 1, 5, 2, 4)  # [P, o, G, nibble, v, c]
        q = q.reshape(p * Q4_PANEL, groups, Q4_GROUP).float()  # [NP, G, 32]

        def per_output(t):  # [P, G*16] -> [NP, G, 1]
            return t.view(p, groups, Q4_PANEL).permute(0, 2, 1).reshape(p * Q4_PANEL, groups, 1).float()

        w = q * per_output(self.step) + per_output(self.minimum)
        return w.reshape(p * Q4_PANEL, -1)[: self.out_features, : self.in_features]  # [N, K]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, w4a8"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not _low_bit_ok(x):
            return F.linear(x, self.dequantized().to(x.dtype), self.bias)
        y = _rowdot_ext().rowdot_linear_w4a8(x.reshape(-1, self.in_features), self.qweight, self.step, self.minimum,
                                             self.out_features, self.bias)
        return y.view(*x.shape[:-1], self.out_features)


def _q4_panels(t: torch.Tensor, np_: int) -> torch.Tensor:
    """Per-group values [N, G] as the kernel reads them: fp16 [P, G*16], output o of panel p
    at [p, 16 g + o], padded with zeros to ``np_`` outputs."""
    n, g0 = t.shape
    out = torch.zeros(np_, g0, dtype=torch.float32)
    out[:n] = t.float()
    return out.view(np_ // Q4_PANEL, Q4_PANEL, g0).permute(0, 2, 1).reshape(np_ // Q4_PANEL, g0 * Q4_PANEL).half()


class RowSiLU(nn.Module):
    """SiLU for the Hugging Face MLP (``act_fn``) with every element computed the same way wherever
    it falls: torch's SiLU takes a vector exp for most of a block and a scalar one for its last
    elements, and splits a tensor into blocks by its size and the thread count, so an element's last
    bit depended on how many rows ran together (13 of 30 rows of [5, 18944] on 16 threads). This
    is ``rowdot_silu_mul`` with up = 1 (an exact multiply); the lean forward calls that kernel itself.
    Like ``InvariantLinear``, only steps of at most ``max_rows`` tokens per sequence: a prefill (or a
    teacher's long forward in train-draft) keeps torch's SiLU and its numerics."""

    def __init__(self, max_rows: int) -> None:
        super().__init__()
        self.max_rows, self.enabled = max_rows, True

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        if not (self.enabled and _low_bit_ok(g) and step_tokens(g, g.shape[-1]) <= self.max_rows):
            return F.silu(g)
        flat = g.reshape(-1, g.shape[-1])  # [M, I]
        gu = torch.cat([flat, torch.ones_like(flat)], dim=-1)  # [M, 2I]
        return _rowdot_ext().rowdot_silu_mul(gu, g.shape[-1]).view(g.shape)


def _use_row_silu(model: nn.Module, max_rows: int) -> None:
    """Swap every SiLU ``act_fn`` (transformers' ``SiLUActivation``, ``nn.SiLU``) for ``RowSiLU``."""
    for mod in model.modules():
        act = getattr(mod, "act_fn", None)
        if isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation":
            mod.act_fn = RowSiLU(max_rows)


def fuse_linears(mods: Sequence[nn.Module]) -> nn.Module | None:
    """One module computing ``torch.cat([m(x) for m in mods], -1)`` in one kernel call, for Choral's
    integer modules of one kind over the same input (q, k and v; gate and up). Each output row is the
    same dot product either way, so the results are bitwise those of the separate calls. The
    originals then hold views of the fused storage: no second copy. None where the modules differ
    in kind, input width or bias, or are fp32."""
    kinds = {type(m) for m in mods}
    if len(kinds) != 1 or len({m.in_features for m in mods}) != 1 or len({m.bias is None for m in mods}) != 1:
        return None
    kind = kinds.pop()
    if kind is Q4Linear:
        if any(m.out_features % Q4_PANEL for m in mods):  # a padded panel inside the fused rows
            return None
        names = ("qweight", "step", "minimum")
    elif kind is Int8Linear:
        names = ("qweight", "scale", "row_sums")
    else:  # fp32 layers keep the model's own Parameters (an optimizer or a tied head may hold them)
        return None
    fused = object.__new__(kind)
    nn.Module.__init__(fused)
    fused.__dict__.update({k: v for k, v in mods[0].__dict__.items() if not k.startswith("_")})
    fused.out_features = sum(m.out_features for m in mods)
    bounds = [0]
    for m in mods:
        bounds.append(bounds[-1] + m.out_features)
    spans = list(zip(bounds[:-1], bounds[1:]))
    per = Q4_PANEL if kind is Q4Linear else 1  # a Q4Linear's buffers hold a panel of outputs per row
    with torch.no_grad():
        for name in names:
            fused.register_buffer(name, torch.cat([getattr(m, name) for m in mods]).contiguous())
            for m, (a, b) in zip(mods, spans):
                m._buffers[name] = getattr(fused, name)[a // per : b // per]
        fused.bias = None
        if mods[0].bias is not None:
            fused.bias = nn.Parameter(torch.cat([m.bias.detach() for m in mods]), requires_grad=False)
            for m, (a, b) in zip(mods, spans):
                m.bias = nn.Parameter(fused.bias.detach()[a:b], requires_grad=False)
    return fused


def _rowwise_sdpa(module, query, key, value, attention_mask, *args, **kwargs):
    """Attention for each query row over exactly the keys that row may attend to: the C++ kernel
    (``rowdot_attention``), or ``_gqa_row`` one row at a time where the kernel cannot run (no
    compiler, autograd); prefills (more rows than ``max_rows``) go to SDPA."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q_len = query.shape[2]
    scaling = kwargs.get("scaling")
    scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
    step = q_len == 1 if attention_mask is None else (attention_mask.dtype == torch.bool and q_len <= _rowwise_sdpa.max_rows)
    no_grad = not (torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad))
    if step and no_grad and query.dtype == torch.float32 and key.dtype == torch.float32 and _rowdot_ext() is not None:
        # The kernel: every row over exactly the slots its own mask row allows, in a fixed order.
        b, s = query.shape[0], key.shape[2]
        if attention_mask is None:  # a 1-token step on a dynamic cache sees every key
            mask = torch.ones(b, 1, s, dtype=torch.bool, device=query.device)  # [B, 1, S]
        else:
            mask = attention_mask[:, 0, :, :s].expand(b, q_len, s)  # [B, T, S]
        out = _rowdot_ext().rowdot_attention(query.transpose(1, 2), key, value, mask, float(scaling))
        return out, None  # [B, T, H, D]
    if attention_mask is None and q_len == 1:  # a 1-token step on a dynamic cache: every key, as a masked step's row
        return _gqa_row(query, key, value, None, scaling), None
    if attention_mask is None or attention_mask.dtype != torch.bool or q_len > _rowwise_sdpa.max_rows:
        # No mask: a causal prefill.
        if attention_mask is not None and attention_mask.dtype == torch.bool:
            # A prefill into a static cache: slots past the last one any query sees are masked
            # anyway; leaving them out makes a 400-token prompt in a 2048-slot cache ~5x less work.
            seen = attention_mask.flatten(0, 2).any(dim=0).nonzero()  # [n, 1] visible slots
            n = int(seen.max()) + 1 if seen.numel() else key.shape[2]
            key, value, attention_mask = key[:, :, :n], value[:, :, :n], attention_mask[..., :n]
        return sdpa_attention_forward(module, query, key, value, attention_mask, *args, **kwargs)
    # Each (sequence, query row) over exactly its own keys, one call each: the call the one-token
    # step of that sequence alone makes at that position, so the reduction never depends on what
    # else is in the batch (over the batch's longest extent, a row's softmax and value sums round
    # differently on AVX-512). Slow, and only where the C++ kernel cannot run.
    lengths, full = _row_extents(attention_mask)
    rows = []
    for b in range(query.shape[0]):
        mb = b if attention_mask.shape[0] > 1 else 0  # a mask may be broadcast over the batch
        outs = []
        for i, (n, dense) in enumerate(zip(lengths[mb], full[mb])):
            mask = None if dense else attention_mask[mb : mb + 1, :, i : i + 1, :n]
            outs.append(_gqa_row(query[b : b + 1, :, i : i + 1], key[b : b + 1, :, :n], value[b : b + 1, :, :n], mask, scaling))
        rows.append(torch.cat(outs, dim=1))
    return torch.cat(rows, dim=0), None


def _row_extents(attention_mask: torch.Tensor) -> tuple[list[list[int]], list[list[bool]]]:
    """For each sequence and query row of a step's boolean mask [B, 1, q, kv]: how many key slots it
    needs (up to the last one it may see) and whether none is masked inside that range. Every layer
    of a forward gets the same mask tensor, so this (and its host sync) runs once per forward, not
    once per layer."""
    cached = _row_extents.last
    if cached is not None and cached[0]() is attention_mask:
        return cached[1]
    allowed = attention_mask.any(dim=1)  # [B, q, kv]
    pos = torch.arange(1, allowed.shape[-1] + 1, device=allowed.device)
    lengths = (allowed * pos).amax(dim=-1)  # [B, q] keys up to the last allowed one
    full = (allowed.sum(dim=-1) == lengths) & (lengths > 0)  # [B, q] nothing masked inside (a padding row keeps its mask)
    got = ([[max(int(n), 1) for n in row] for row in lengths.tolist()], full.tolist())
    _row_extents.last = (weakref.ref(attention_mask), got)
    return got


_row_extents.last = None


def _gqa_row(query, key, value, mask, scaling: float) -> torch.Tensor:
    """Attention of one query row per sequence over ``n`` keys, the query heads grouped onto their
    key/value head (no copies of the keys): two small matmuls and a softmax, where SDPA's CPU flash
    kernel is built for long query blocks. Row i of a verify makes the same call, with the same
    keys, as the one-token step at that position, so the two are bitwise equal."""
    b, h, _, d = query.shape  # query [B, H, 1, D]; key, value [B, Hkv, n, D]; mask [B, 1, 1, n] or None
    hkv = key.shape[1]
    scores = torch.matmul(query.reshape(b, hkv, h // hkv, d), key.transpose(-1, -2)) * scaling  # [B, Hkv, H/Hkv, n]
    if mask is not None:  # a finite floor, as eager attention: a fully masked (padding) row stays finite
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    out = torch.matmul(torch.softmax(scores, dim=-1), value)  # [B, Hkv, H/Hkv, D]
    return out.reshape(b, 1, h, d)  # [B, 1, H, D], the layout attention interfaces return


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
    lean: bool = True,
    cache: bool = True,
    requantize: bool = False,
) -> nn.Module:
    """Make the forward of `model` batch-invariant and cheap for small token counts, in place.

    token_counts: the step sizes that must agree with each other (checked on every distinct
      Linear shape; a shape that fails falls back to F.linear with a warning).
    kernel: "rowdot" (the C++ kernel), "mkl" (packed sgemm, no compiler needed) or "auto".
    max_rows: steps of more tokens per sequence than this (prefill) use the library kernels; a
      batch of shorter steps stays on the kernels however many sequences it holds.
    attention: also switch a Hugging Face model to the row-wise SDPA.
    weights: "fp32" keeps the model's numerics (for the target); "int8" stores every Linear as
      W8A8 int8 (`Int8Linear`, needs the C++ kernel): ~2.4x cheaper steps, different numerics
      (a draft's never change the speculative output; a target's output becomes the int8
      model's). "q4" stores every Linear whose weights lie on a 4-bit lattice (a GGUF's Q4_K
      tensors, ``q4_lattice``) as ``Q4Linear`` and the others (Q6_K tensors) as ``Int8Linear``.
    own_tensors: with int8, give the tensors kept in fp32 storage of their own (``_own_tensors``);
      False for a copy that shares them with a model that keeps its mapping anyway (train-draft's
      evaluation of the student it is training: a clone would be 0.5 GB for nothing).
    lean: where the model fits (Qwen2, Llama), have ``ModelRunner`` run it through
      ``serving.engine.decoder.LeanDecoder`` (fused projections, a dozen calls a layer) instead of
      the Hugging Face forward.
    cache: with int8 or q4, keep the converted layers of a model loaded from a folder (and not
      changed since) under CHORAL_HOME/prepared and load them next time instead of converting
      (``serving.engine.weights_cache``).
    requantize: with q4, round the Linears that are not on a 4-bit lattice into 4-bit groups
      (``q4_requantize``) instead of keeping them int8. For drafts: the bundled 0.5B's GGUF holds
      almost no Q4_K tensors (its 896-wide rows are not whole 256-weight super-blocks, so llama.cpp
      wrote Q5_0/Q8_0), and as int8 its step reads 0.5 GB, half the q4 target's.
    """
    counts = sorted({1, *token_counts})
    kernel = _pick_kernel(weights, kernel, counts, max_rows)
    model.eval().requires_grad_(False)
    targets = [(f"{prefix}.{name}" if prefix else name, parent, name, child)
               for prefix, parent in list(model.named_modules()) for name, child in list(parent.named_children())
               if type(child) is nn.Linear and child.weight.dtype == torch.float32]  # fmt: skip
    # A model as loaded from its folder finds its low-bit layers converted by an earlier run.
    entry = None
    if cache and weights != "fp32":
        kind = "q4-requantized" if weights == "q4" and requantize else weights
        entry = weights_cache.entry(model, kind, [(full, child) for full, _, _, child in targets])
    stored = weights_cache.load(entry, stored_layer) if entry is not None else None
    converted, fresh = _convert_linears(targets, stored, weights, kernel, max_rows, counts, requantize)
    if entry is not None and converted and fresh:
        weights_cache.save(entry, converted)  # before fuse_linears makes the layers views of shared storage
    if weights == "q4":
        kinds = [type(m).__name__ for m in model.modules()]
        log.info("choral: q4 weights: %d Linear layers in 4-bit groups, %d not on a 4-bit lattice in int8",
                 kinds.count("Q4Linear"), kinds.count("Int8Linear"))
    if weights != "fp32" and own_tensors:
        _own_tensors(model)
    if kernel == "rowdot":
        _use_row_silu(model, max_rows)
    if attention and hasattr(model, "set_attn_implementation"):
        _rowwise_sdpa.max_rows = max_rows
        _use_rowwise_attention(model)
        if kernel == "rowdot" and lean:
            model._choral_decoder = LeanDecoder.build(model, _rowdot_ext(), fuse_linears, max_rows)
    return model


def _pick_kernel(weights: str, kernel: str, counts: list[int], max_rows: int) -> str:
    """The kernel ``prepare_for_cpu`` runs ("rowdot" or "mkl"), after checking its arguments."""
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    if weights != "fp32" and _rowdot_ext() is None:
        raise RuntimeError(f"{weights} weights need the rowdot C++ kernel, which could not be built here; "
                           "use fp32 weights")
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    if kernel in ("auto", "rowdot") and _rowdot_ext() is None:
        if kernel == "rowdot":
            raise RuntimeError("the rowdot kernel could not be built on this machine")
        kernel = "mkl"
    elif kernel == "auto":
        kernel = "rowdot"
    if max(counts) > max_rows:
        # A step of K drafts verifies K + 1 tokens: name the setting that asked for the width.
        raise ValueError(f"step widths {counts} exceed max_rows={max_rows}: the CPU kernels take steps of at most "
                         f"{max_rows} tokens a sequence, so K can be at most {max_rows - 1} (engine.k, k_buckets, "
                         f"request_k_max; a K of {max(counts) - 1} asked for {max(counts)}): lower the largest of "
                         "k_buckets or set engine.cpu_kernels=false")  # fmt: skip
    return kernel


def _convert_linears(targets, stored, weights, kernel, max_rows, counts, requantize) -> tuple[dict[str, nn.Module], bool]:
    """Swap each fp32 Linear of ``targets`` (full name, parent, attribute, layer) for its kernel
    module (taken from ``stored`` where the cache held it), where that module is batch-invariant
    for ``counts`` (checked once per layer shape). Returns the swapped modules by name and whether
    any was converted here rather than loaded."""
    checked: dict[tuple, bool] = {}
    converted: dict[str, nn.Module] = {}
    fresh = False  # some layer converted here rather than loaded
    for full, parent, name, child in targets:
        new = stored.get(full) if stored is not None else None
        if new is not None and (new.in_features, new.out_features) != (child.in_features, child.out_features):
            new = None
        built = new is None
        if built:
            lattice = q4_lattice(child.weight) if weights == "q4" else None
            if lattice is None and weights == "q4" and requantize:
                lattice = q4_requantize(child.weight)
            if lattice is not None:
                new = Q4Linear(child, lattice)
            elif weights in ("int8", "q4"):
                new = Int8Linear(child)
            else:
                new = InvariantLinear(child, kernel, max_rows, pack_rows=max(2, counts[-1]))
        key = (type(new).__name__, child.out_features, child.in_features, child.bias is not None)
        if key not in checked:
            checked[key] = _check_invariance(new, counts)
            if not checked[key]:
                log.warning("choral: %s kernel not batch-invariant for Linear%s; using F.linear", kernel, key)
        if checked[key]:
            setattr(parent, name, new)
            converted[full] = new
            fresh |= built
    return converted, fresh


def stored_layer(name: str, kind: str, in_features: int, out_features: int, tensors: dict[str, torch.Tensor]) -> nn.Module:
    """A layer of the prepared-weights cache (``weights_cache.load``) from its stored buffers."""
    bias = tensors.get(f"{name}.bias")
    if kind == "Q4Linear":
        return Q4Linear.from_buffers(in_features, out_features, tensors[f"{name}.qweight"], tensors[f"{name}.step"],
                                     tensors[f"{name}.minimum"], bias)  # fmt: skip
    if kind == "Int8Linear":
        return Int8Linear.from_buffers(in_features, tensors[f"{name}.qweight"], tensors[f"{name}.scale"], bias,
                                       tensors[f"{name}.row_sums"])  # fmt: skip
    raise ValueError(f"unknown layer kind {kind!r}")

@torch.no_grad()
def _own_tensors(model: nn.Module) -> None:
    """Give the tensors an int8 draft keeps in fp32 (embeddings, norms) storage of their own.
    Models load memory-mapped from their safetensors file, and every page the int8 conversion read
    counts as resident for as long as any tensor still points into that mapping: 1.4 GB of a 0.5B
    draft's 2.5 GB file stayed resident through its fp32 embedding alone. Owning the few kept
    tensors releases the mapping."""
    seen: set[int] = set()  # a tied weight (embedding and head) is one tensor, cloned once
    for mod in model.modules():
        if isinstance(mod, (Int8Linear, Q4Linear)):
            continue  # converted here, or read whole from the prepared cache: never the model's mapping
        for t in (*mod.parameters(recurse=False), *mod.buffers(recurse=False)):
            if id(t) not in seen:
                seen.add(id(t))
                t.data = t.data.clone()


def set_enabled(model: nn.Module, enabled: bool) -> None:
    """Switch a prepared model between its invariant kernels and the stock ones (for A/B)."""
    for m in model.modules():
        if isinstance(m, (InvariantLinear, RowSiLU)):
            m.enabled = enabled
    if getattr(model, "_choral_decoder", None) is not None:
        model._choral_decoder.enabled = enabled
    before = getattr(model, "_choral_attn_before", None)
    if before is not None:
        model.set_attn_implementation(ATTN_NAME if enabled else before)


DRAFT_WEIGHTS = ("auto", "fp32", "int8", "q4")
TARGET_WEIGHTS = ("fp32", "int8", "q4")


def drafts_precision(draft_weights: str, *, applies: bool, target_weights: str = "fp32") -> str:
    """The precision drafts run at: ``auto`` is q4 beside a q4 target and int8 beside any other
    where the CPU kernels apply (CPU, fp32, no quantize) and the C++ kernel builds, else fp32
    (``scripts/experiments/profile_step.py --as-draft`` times the two); another choice stands
    where they apply (where they do not, ``use_cpu_kernels`` refuses int8 and q4) and is fp32 otherwise."""
    if draft_weights == "auto":
        if not (applies and rowdot_available()):
            return "fp32"
        return "q4" if target_weights == "q4" else "int8"
    return draft_weights if applies else "fp32"


def use_cpu_kernels(
    models: list[PreTrainedModel],
    *,
    device,
    dtype,
    widths,
    quantize: str | None = None,
    drafts: list[PreTrainedModel] = (),
    draft_weights: str = "fp32",
    own_draft_tensors: bool = True,
    target_weights: str = "fp32",
    weights_cache: bool = True,
) -> bool:
    """Swap in ``serving.engine.cpu_kernels`` where they apply (CPU, fp32, not quantized), so that
    verifying any of ``widths`` tokens costs about one token and rows are bitwise identical.
    ``models`` keep their fp32 numerics (targets); ``drafts`` get ``draft_weights``: "int8" stores
    them as W8A8 int8 (~2.5x cheaper steps; a draft's numerics never change the output, only how
    much of it is accepted), "q4" stores them in 4-bit groups: a GGUF draft's own Q4_K groups
    as ``target_weights`` q4 does, every other Linear rounded into groups (``q4_requantize``),
    "auto" is ``drafts_precision``'s choice beside ``target_weights``, "fp32" keeps them as
    they are (``own_draft_tensors``: see ``prepare_for_cpu``'s ``own_tensors``). ``target_weights``
    "int8" stores the ``models`` as W8A8 int8 too, "q4" keeps their 4-bit GGUF tensors in 4-bit
    groups (W4A8) and the rest in int8: their numerics change
    (the output is then that precision's target's), their rows stay batch-invariant.
    ``weights_cache``: reuse int8/q4 conversions stored by an earlier run (``prepare_for_cpu``'s
    ``cache``). Returns whether the kernels were applied."""
    if draft_weights not in DRAFT_WEIGHTS:
        raise ValueError(f"draft_weights={draft_weights!r} must be one of {DRAFT_WEIGHTS}")
    applies = torch.device(device).type == "cpu" and resolve_dtype(dtype) == torch.float32 and quantize is None
    if draft_weights == "auto":
        draft_weights = drafts_precision("auto", applies=applies, target_weights=target_weights)
    if target_weights not in TARGET_WEIGHTS:
        raise ValueError(f"target_weights={target_weights!r} must be one of {TARGET_WEIGHTS}")
    if target_weights != "fp32" and not (applies and rowdot_available()):
        raise ValueError(f"target_weights={target_weights!r} needs the CPU kernels: device cpu, dtype float32, no quantize "
                         f"and the C++ kernel (got device {device}, dtype {dtype}); use target_weights=fp32")  # fmt: skip
    if not applies:
        if draft_weights in ("int8", "q4") and drafts:
            raise ValueError(f"draft_weights={draft_weights!r} needs the CPU kernels: device cpu, dtype float32, "
                             f"no quantize (got device {device}, dtype {dtype}); use draft_weights=fp32")
        return False
    for model in models:
        prepare_for_cpu(model, token_counts=widths, weights=target_weights, cache=weights_cache)
    for model in drafts:
        prepare_for_cpu(model, token_counts=widths, weights=draft_weights, own_tensors=own_draft_tensors,
                        cache=weights_cache, requantize=True)
    return True
