"""Distillation losses between a student (the draft) and a teacher (the target).

    loss_fn = DistillLoss("jsd", ce_ratio=0.1, temperature=1.0, beta=0.5)
    with torch.no_grad():
        teacher_logits = target(input_ids).logits                  # [B, T, V]
    loss, parts = loss_fn(draft(input_ids).logits, teacher_logits, labels)
    loss.backward()                                                # parts: {"ce", "divergence"}, detached

Conventions shared by every loss here:

* ``p`` is the teacher's next-token distribution, ``q`` the student's; both logits are ``[B, T, V]``
  and already aligned with ``labels``/``mask`` ``[B, T]`` (position ``t`` predicts ``labels[t]``):
  nothing here shifts.
* The result is the mean over real tokens (``mask`` true, i.e. ``labels != -100``): a per-token
  mean, so every real token weighs the same whatever its sequence's length, and padded positions
  (with any logits) change nothing. No real token at all gives 0, not NaN.
* ``temperature`` divides both logits before the softmax. The KL-based divergences (forward KL,
  reverse KL, JSD) are multiplied by ``temperature**2`` (Hinton et al., 2015): their gradient with
  respect to the logits shrinks like ``1/T**2``, so the scaling keeps its size comparable across
  temperatures. Total variation is left unscaled so that it stays the bounded quantity
  ``1 - acceptance rate`` of speculative sampling. Cross-entropy against labels ignores the
  temperature (hard labels have none).
* The teacher's logits are detached: gradients reach the student only.
* Widths must match. A Qwen student derived from its target keeps the target's (padded) vocabulary
  width; a draft whose width differs must be sliced by the caller (``teacher_logits[..., :V]``), which
  is only correct when the extra columns are padding rows the tokenizer never emits.
* Everything is computed in float32 from ``log_softmax`` (no ``log(0)``); log-probabilities are
  clamped to the most negative finite float so that ``-inf`` logits (masked vocabulary) give finite
  values and gradients instead of NaN. Nothing is chunked: the caller bounds ``B * T * V``.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` [B, T] over the positions where ``mask`` [B, T] is true; 0 if none."""
    mask = mask.bool()
    # where, not multiply: a padded position holding inf/NaN must not leak into the sum.
    total = torch.where(mask, values, torch.zeros_like(values)).sum()
    return total / mask.sum().clamp(min=1).to(values.dtype)


def _log_probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = F.log_softmax(logits.float() / temperature, dim=-1)  # [B, T, V]
    return logp.clamp(min=torch.finfo(logp.dtype).min)


def _check_inputs(student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor) -> None:
    if student_logits.shape[-1] != teacher_logits.shape[-1]:
        raise ValueError(
            f"student vocab width {student_logits.shape[-1]} != teacher width {teacher_logits.shape[-1]}: "
            "slice the teacher's logits to the student's width (teacher_logits[..., :V]) if its extra "
            "columns are vocabulary padding the tokenizer never emits; otherwise the models do not share a vocabulary"
        )
    if student_logits.shape != teacher_logits.shape:
        raise ValueError(f"student logits {tuple(student_logits.shape)} != teacher logits {tuple(teacher_logits.shape)}")
    if mask.shape != student_logits.shape[:-1]:
        raise ValueError(f"mask {tuple(mask.shape)} must be the logits' shape without the vocab: {tuple(student_logits.shape[:-1])}")


def _check_temperature(temperature: float) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")


def _log_probs_pair(student_logits, teacher_logits, mask, temperature):
    """Checked inputs as log-probabilities (student, teacher), the teacher detached."""
    _check_inputs(student_logits, teacher_logits, mask)
    _check_temperature(temperature)
    return _log_probs(student_logits, temperature), _log_probs(teacher_logits.detach(), temperature)


def _kl(log_a: torch.Tensor, log_b: torch.Tensor) -> torch.Tensor:
    """KL(a || b) per position: [B, T, V] log-probabilities -> [B, T]."""
    return (log_a.exp() * (log_a - log_b)).sum(-1)


def forward_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """``KL(p || q) * T**2``: mode-covering; the student pays for every token the teacher likes."""
    log_q, log_p = _log_probs_pair(student_logits, teacher_logits, mask, temperature)
    return masked_mean(_kl(log_p, log_q), mask) * temperature**2


def reverse_kl(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """``KL(q || p) * T**2``: mode-seeking; the student pays for mass where the teacher has little."""
    log_q, log_p = _log_probs_pair(student_logits, teacher_logits, mask, temperature)
    return masked_mean(_kl(log_q, log_p), mask) * temperature**2


def generalized_jsd(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Generalized Jensen-Shannon divergence (GKD, Agarwal et al. 2024; DistillSpec), times ``T**2``.

    ``JSD_beta = beta * KL(p || m) + (1 - beta) * KL(q || m)`` with the mixture
    ``m = beta * p + (1 - beta) * q``, so ``beta`` is the teacher's weight in the mixture.
    ``beta = 0.5`` is the symmetric JSD (at most ``log 2``). As ``beta -> 0`` the divergence
    behaves like ``beta * KL(p || q)`` (forward KL), as ``beta -> 1`` like
    ``(1 - beta) * KL(q || p)`` (reverse KL). The endpoints themselves would be identically 0, so,
    as in GKD and TRL, ``beta = 0`` returns the forward KL and ``beta = 1`` the reverse KL: the
    value's scale jumps there, which matters when comparing losses across a sweep of ``beta``.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be in [0, 1], got {beta}")
    if beta == 0.0:
        return forward_kl(student_logits, teacher_logits, mask, temperature=temperature)
    if beta == 1.0:
        return reverse_kl(student_logits, teacher_logits, mask, temperature=temperature)
    log_q, log_p = _log_probs_pair(student_logits, teacher_logits, mask, temperature)
    log_m = torch.logaddexp(log_p + math.log(beta), log_q + math.log(1.0 - beta))  # [B, T, V], log of the mixture
    return masked_mean(beta * _kl(log_p, log_m) + (1.0 - beta) * _kl(log_q, log_m), mask) * temperature**2


def total_variation(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """``0.5 * sum_v |p - q|`` in [0, 1], not scaled by ``T**2``.

    At temperature 1 this is exactly ``1 - `` the probability that speculative sampling accepts
    the draft's token (Leviathan et al., 2023), the quantity DistillSpec optimises directly.
    """
    log_q, log_p = _log_probs_pair(student_logits, teacher_logits, mask, temperature)
    return masked_mean(0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1), mask)


def cross_entropy(
    student_logits: torch.Tensor,
    labels: torch.Tensor,
    *,
    mask: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """Mean negative log-likelihood of ``labels`` [B, T] over the positions of ``mask`` [B, T]
    (default: labels not equal to ``ignore_index``; labels outside the mask may hold anything)."""
    if labels.shape != student_logits.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} must be the logits' shape without the vocab: {tuple(student_logits.shape[:-1])}")
    mask = labels != ignore_index if mask is None else mask.bool()  # [B, T]
    if mask.shape != labels.shape:
        raise ValueError(f"mask {tuple(mask.shape)} must have the labels' shape {tuple(labels.shape)}")
    log_q = _log_probs(student_logits, 1.0)  # [B, T, V]
    # Ignored positions gather index 0 and are then masked out: any index is fine there.
    nll = -log_q.gather(-1, torch.where(mask, labels, 0).unsqueeze(-1)).squeeze(-1)  # [B, T]
    return masked_mean(nll, mask)


Divergence = Callable[..., torch.Tensor]

DIVERGENCES: dict[str, Divergence] = {
    "forward_kl": forward_kl,
    "reverse_kl": reverse_kl,
    "jsd": generalized_jsd,
    "tvd": total_variation,
}
"""The divergences ``DistillLoss`` accepts by name."""


KINDS = ("ce", *DIVERGENCES)
"""What ``DistillLoss`` accepts: ``ce`` trains on labels alone, the others distill."""


class DistillLoss(nn.Module):
    """``ce_ratio * CE(labels) + (1 - ce_ratio) * divergence(teacher, student)``.

    Args:
        kind: one of ``KINDS``: a divergence of ``DIVERGENCES`` (``forward_kl``, ``reverse_kl``,
            ``jsd``, ``tvd``), or ``ce`` for cross-entropy against labels alone (``ce_ratio`` and
            the teacher's logits are then ignored).
        ce_ratio: weight of the cross-entropy against labels, in [0, 1]; at 1 the teacher's
            logits may be None.
        temperature: divides both logits before the divergence's softmax (see module notes).
        beta: the teacher's weight in the JSD mixture (``kind="jsd"`` only; see ``generalized_jsd``).

    ``forward`` returns ``(loss, parts)``: ``loss`` to backpropagate and ``parts``, detached for
    logging: ``{"ce": ..., "divergence": ...}`` (no ``divergence`` when none was computed).
    """

    def __init__(self, kind: str = "forward_kl", ce_ratio: float = 0.0, temperature: float = 1.0, beta: float = 0.5):
        super().__init__()
        if kind not in KINDS:
            raise ValueError(f"unknown loss kind {kind!r}; valid kinds: {', '.join(KINDS)}")
        if not 0.0 <= ce_ratio <= 1.0:
            raise ValueError(f"ce_ratio must be in [0, 1], got {ce_ratio}")
        _check_temperature(temperature)
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        self.kind, self.temperature, self.beta = kind, temperature, beta
        self.ce_ratio = 1.0 if kind == "ce" else ce_ratio

    def divergence(self, student_logits: torch.Tensor, teacher_logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.kind == "jsd":
            return generalized_jsd(student_logits, teacher_logits, mask, beta=self.beta, temperature=self.temperature)
        return DIVERGENCES[self.kind](student_logits, teacher_logits, mask, temperature=self.temperature)

    def forward(
        self,
        student_logits: torch.Tensor,
        teacher_logits: torch.Tensor | None,
        labels: torch.Tensor,
        mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``student_logits``/``teacher_logits`` [B, T, V], ``labels`` [B, T]. The tokens trained
        on are ``mask`` [B, T] when given (labels elsewhere are ignored, whatever their value),
        else ``labels != -100`` (padding, and prompt tokens when only answers are distilled)."""
        if mask is None:
            mask = labels != IGNORE_INDEX
        ce = cross_entropy(student_logits, labels, mask=mask)
        if self.ce_ratio == 1.0:
            return ce, {"ce": ce.detach()}
        if teacher_logits is None:
            raise ValueError(f"teacher_logits is required unless ce_ratio == 1 (got ce_ratio={self.ce_ratio})")
        div = self.divergence(student_logits, teacher_logits, mask)
        loss = self.ce_ratio * ce + (1.0 - self.ce_ratio) * div
        return loss, {"ce": ce.detach(), "divergence": div.detach()}

    def extra_repr(self) -> str:
        return f"kind={self.kind!r}, ce_ratio={self.ce_ratio}, temperature={self.temperature}, beta={self.beta}"
