"""The K policy: how many tokens each row may draft this step.

A row's budget is its request's own K (``Request.k``, vLLM's ``num_speculative_tokens``), else its
drafter's own ``k``, else the engine's: a fixed K, or with ``k: auto`` the request's own K value,
moved by Hugging Face's heuristic on the request's own verdicts (+2 after a full accept, else -1),
so a request's K never depends on what shares the batch. With ``step_k: goodput`` the step's
budgets are then capped at the K that maximises the batch's expected tokens per ms
(``serving.engine.goodput.plan_cap``); seeded sampled rows keep theirs.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from serving.engine.drafters.base import NONE, Drafter
from serving.engine.engine_settings import EngineConfig
from serving.engine.goodput import StepCosts, expected_from_counts, per_token_acceptance, plan_cap
from serving.engine.slots import Slot


class KPolicy:
    def __init__(self, config: EngineConfig, drafters: Mapping[str, Drafter]) -> None:
        self.config, self.drafters = config, drafters
        # Where each request's K starts; with "auto" every request then moves its own K.
        self.k_start = float(config.k_buckets[len(config.k_buckets) // 2] if config.k == "auto" else config.k)

    def row_k(self, slot: Slot | None) -> int:
        """The request's draft budget this step: 0 for ``none``; the request's own K, else its
        drafter's own k, else the engine's k, or with "auto" the largest bucket the request's own
        K value reaches."""
        if slot is None or slot.drafter == NONE or not self.drafters:
            return 0
        if slot.request.k is not None:
            return min(slot.request.k, self.config.k_max)
        own = self.drafters[slot.drafter].k
        if own is not None:
            return min(own, self.config.k_max)
        if self.config.k != "auto":
            return int(self.config.k)
        fitting = [k for k in self.config.k_buckets if k <= slot.k_value]
        return fitting[-1] if fitting else self.config.k_buckets[0]

    def prior(self, slot: Slot) -> None:
        """step_k goodput: the row's per-token acceptance before its own record, from the router's
        predicted acceptance when the request carries one."""
        if slot.request.expected_acceptance is not None and self.config.step_k == "goodput":
            k = max(1, self.row_k(slot))
            slot.prior_a = float(per_token_acceptance(torch.tensor([float(slot.request.expected_acceptance)]), k))

    def after_step(self, slot: Slot, budget: int, drafted: int, accepted: int) -> None:
        """k: auto moves the request's own K by its own verdict (Hugging Face's heuristic)."""
        if self.config.k == "auto" and budget:
            lo, hi = self.config.k_buckets[0], self.config.k_buckets[-1]
            slot.k_value = min(hi, slot.k_value + 2) if accepted == drafted else max(lo, slot.k_value - 1)

    def cap(self, slots: Sequence[Slot | None], k_rows: list[int], proposed: Sequence[int | None] | None,
            step_costs: StepCosts) -> list[int]:  # fmt: skip
        """step_k goodput: the budgets capped at the K that maximises the batch's expected tokens per
        ms. ``proposed[b]``: the length of a proposal already made for row b (a host drafter's,
        known once proposed), else None: its budget is then an upper bound, so a cap of 0 stays 0
        and the proposals need not be made. Seeded sampled rows keep theirs."""
        if self.config.step_k != "goodput":
            return k_rows
        keep = [slot is not None and slot.request.params.seeded_sampling for slot in slots]
        expected, fixed, model_budget = [], [], 0
        for b, slot in enumerate(slots):
            if slot is None:
                continue
            known = proposed[b] if proposed is not None else None
            budget = known if known is not None else k_rows[b]
            drafter = self.drafters.get(slot.drafter)
            if drafter is not None and drafter.owns_rows:
                model_budget = max(model_budget, budget)
            st = slot.stats
            expected.append(expected_from_counts(st.accepted_at, st.drafted_at, budget, slot.prior_a))
            fixed.append(keep[b])
        B = len(slots)
        cap = plan_cap(expected, fixed, lambda c: step_costs.step_ms(B, c, model_budget), self.config.k_buckets)
        if cap is None:
            return k_rows
        return [k if keep[b] else min(k, cap) for b, k in enumerate(k_rows)]
