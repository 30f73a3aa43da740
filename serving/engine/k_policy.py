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


# The pooled prior of a drafter (``KPolicy.pooled_a``): where it starts (in-family drafts and copy
# drafters on their own text measured 0.7-0.9 per token), how many tokens that start weighs, and the
# decay per verdict (about the last thousand drafted tokens count).
POOL_START, POOL_WEIGHT, POOL_DECAY = 0.8, 16.0, 0.999


class KPolicy:
    def __init__(self, config: EngineConfig, drafters: Mapping[str, Drafter]) -> None:
        self.config, self.drafters = config, drafters
        # Where each request's K starts; with "auto" every request then moves its own K.
        self.cut: set[int] = set()  # the rows whose budget the last cap lowered (a step's "why" in the stats)
        self._pool: dict[str, tuple[float, float]] = {}  # drafter -> (accepted, tested) draft tokens, decaying
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
        predicted acceptance when the request carries one (else its drafter's pooled record, read
        at each cap: ``pooled_a``)."""
        if slot.request.expected_acceptance is not None and self.config.step_k == "goodput":
            k = max(1, self.row_k(slot))
            slot.prior_a = float(per_token_acceptance(torch.tensor([float(slot.request.expected_acceptance)]), k))
            slot.routed_prior = True

    def pooled_a(self, drafter: str) -> float:
        """The drafter's per-token acceptance over the engine's recent steps (every row it drafted),
        smoothed towards an optimistic start (``POOL_START``): a prior that began low would cap every
        row at 0, and a drafter that never drafts never shows it was better than its prior."""
        hits, trials = self._pool.get(drafter, (0.0, 0.0))
        return (hits + POOL_WEIGHT * POOL_START) / (trials + POOL_WEIGHT)

    def after_step(self, slot: Slot, budget: int, drafted: int, accepted: int) -> None:
        """k: auto moves the request's own K by its own verdict (Hugging Face's heuristic); the
        drafter's pooled record (``pooled_a``) counts the verdict, older steps decaying."""
        if drafted:
            hits, trials = self._pool.get(slot.drafter, (0.0, 0.0))
            self._pool[slot.drafter] = (POOL_DECAY * hits + accepted, POOL_DECAY * trials + min(accepted + 1, drafted))
        if self.config.k == "auto" and budget:
            lo, hi = self.config.k_buckets[0], self.config.k_buckets[-1]
            slot.k_value = min(hi, slot.k_value + 2) if accepted == drafted else max(lo, slot.k_value - 1)

    def cap(self, slots: Sequence[Slot | None], k_rows: list[int], proposed: Sequence[int | None] | None,
            step_costs: StepCosts, model_rows: set[int] | None = None) -> list[int]:  # fmt: skip
        """step_k goodput: the budgets capped at the K that maximises the batch's expected tokens per
        ms. ``proposed[b]``: the length of a proposal already made for row b (a host drafter's,
        known once proposed), else None: its budget is then an upper bound, so a cap of 0 stays 0
        and the proposals need not be made. Seeded sampled rows keep theirs."""
        self.cut = set()
        if self.config.step_k != "goodput":
            return k_rows
        # One row alone keeps its K: its drafter's (the client's, the router's, auto's own choice priced at
        # batch 1, the batch it runs in). The cap trades one row's proposal against the batch's: measured on
        # the bundled pair, capping a lone row cost the 0.5B most of its batch-1 gain (1.32x -> 1.06x).
        if sum(slot is not None for slot in slots) < 2:
            return k_rows
        keep = [slot is not None and slot.request.params.seeded_sampling for slot in slots]
        expected, fixed, model_budget = [], [], 0
        for b, slot in enumerate(slots):
            if slot is None:
                continue
            known = proposed[b] if proposed is not None else None
            budget = known if known is not None else k_rows[b]
            drafter = self.drafters.get(slot.drafter)
            # A model drafts the row: its own drafter, or (``model_rows``, once known) auto's choice.
            if (b in model_rows) if model_rows is not None else (drafter is not None and drafter.owns_rows):
                model_budget = max(model_budget, budget)
            st = slot.stats
            # auto's rows are priced by auto's pooled record (keyed by the chosen drafter instead, a
            # batch-8 probe ran 0.94x the target alone against 1.06x: within the machine's noise, not better).
            prior = slot.prior_a if slot.routed_prior else self.pooled_a(slot.drafter)
            expected.append(expected_from_counts(st.accepted_at, st.drafted_at, budget, prior))
            fixed.append(keep[b])
        B = len(slots)
        cap = plan_cap(expected, fixed, lambda c: step_costs.step_ms(B, c, model_budget), self.config.k_buckets)
        if cap is None:
            return k_rows
        out = [k if keep[b] else min(k, cap) for b, k in enumerate(k_rows)]
        self.cut = {b for b, (k, c) in enumerate(zip(k_rows, out)) if c < k}
        return out
