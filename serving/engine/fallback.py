"""Fallback: a row whose drafter stops paying switches to the target alone, mid-request.

The rule (``Fallback``, a request's setting) is a pure function of the row's accepted and drafted
counts; ``fall_back`` applies it to a running slot after a step. The output never changes (every
token is the target's either way); only the drafting the row no longer pays for stops.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from scipy.special import betaincinv

from serving.engine.drafters.base import NONE


@dataclass(frozen=True)
class Fallback:
    """When a request's drafter stops paying, mid-request: once ``after_drafted`` tokens were
    drafted, the row switches to the target alone for the rest of the request if the evidence says
    its acceptance is below ``min_acceptance``: the one-sided Clopper-Pearson upper bound (at
    ``confidence``) on its acceptance, from accepted / drafted so far, is below the floor. A bare
    running rate would drop a drafter on a few unlucky tokens, and misses come in runs: ``ngram``
    proposes nothing right until the answer starts to copy (a quoted-context prompt, int8 target:
    0 of its first 16 drafts accepted, 0.67 over the whole answer). With a floor near 0 (a drafter
    that costs almost nothing) no short run of misses is evidence enough; with a floor of 0.3
    (a draft model) 0 of 12 is. Its output does not change (every token is the target's either
    way); only the drafting it no longer pays for stops."""

    min_acceptance: float
    after_drafted: int = 16
    confidence: float = 0.95

    def __post_init__(self) -> None:
        if not 0.0 <= self.min_acceptance <= 1.0:
            raise ValueError(f"fallback min_acceptance={self.min_acceptance} must be in [0, 1]")
        if self.after_drafted < 1:
            raise ValueError(f"fallback after_drafted={self.after_drafted} must be >= 1")
        if not 0.5 <= self.confidence < 1.0:
            raise ValueError(f"fallback confidence={self.confidence} must be in [0.5, 1) (0.95: one chance in 20 "
                             "that a drafter paying its way is dropped)")

    def fires(self, accepted: int, drafted: int) -> bool:
        """Whether ``accepted`` of ``drafted`` tokens show the acceptance below the floor."""
        if drafted < self.after_drafted or accepted >= drafted:
            return False
        upper = float(betaincinv(accepted + 1, drafted - accepted, self.confidence))  # Clopper-Pearson
        return upper < self.min_acceptance


def fall_back(slot: Any, stop_drafter: Callable[[], None]) -> bool:
    """Switch the slot (``serving.engine.slots.Slot``) to the target alone once its acceptance so far shows it below the request's
    floor (``Fallback.fires``): its drafter is stopped first (``stop_drafter``, which frees the
    drafter's rows), then the row is relabelled. Returns whether it fell back."""
    rule, s = slot.request.fallback, slot.stats
    if rule is None or slot.drafter == NONE or not rule.fires(s.accepted, s.drafted):
        return False
    stop_drafter()
    slot.routed_drafter, slot.drafter = slot.drafter, NONE
    slot.fell_back_at = len(slot.generated)
    return True
