"""Goodput: how many tokens a step commits, what it costs, and the K a whole batch should verify.

A step verifies every row at one width (the longest proposal's K bucket + 1), so in a full batch
one row's long proposal makes every row pay for it. On a CPU a verify of a full batch is bound
by arithmetic, so its cost grows with the width far more than one row's does (the measured tables:
``scripts/experiments/profile_step.py --batch-rows``, docs/experiments/router-workload.md). SmartSpec
(Liu et al. 2024) therefore picks the batch's K each step to maximise goodput, the tokens the
batch is expected to commit per second; ``plan_cap`` is that choice, a pure function:

    cap = argmax over c in {0} + K buckets of  sum_b E_b[min(c, budget_b)] / cost(c)

E_b[j] is what row b is expected to commit if it may propose j tokens (1 + the chance each
drafted position survives), cost(c) the step's ms at that width (``StepCosts``: steps timed at
load and while serving, a profiled table for a shape not timed). Capping a row's proposal never changes a greedy row's
output, only how fast it comes; a seeded sampled row is never capped (its draws would then depend
on the batch), so its budget is a floor on the cap.

The expected-token formulas (Leviathan et al. 2023) live here too: the router prices whole
requests with them (``routing.router``), the engine prices steps. ``RowCosts`` prices one row's
step by its parts (verify by width, each drafter's proposal, a model drafter's catch-up after steps
it skipped): the cost model of choosing a drafter per step (``serving.tools.drafting_replay``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch


def expected_tokens(a: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Tokens committed per verification with per-token acceptance ``a`` and ``k`` drafts
    (broadcasting); the a -> 1 limit is k + 1."""
    a = a.clamp(0.0, 1.0 - 1e-6)
    return (1 - a ** (k + 1)) / (1 - a)


def committed_tokens(a: torch.Tensor, k: torch.Tensor, fill: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Tokens a verification commits when the drafter fills ``fill`` of the slots the geometric
    model assumes (``routing.router``'s docstring): the bonus token plus fill * (E(a, k) - 1)."""
    return 1 + fill * (expected_tokens(a, k) - 1)


def per_token_acceptance(rate: torch.Tensor, k: int) -> torch.Tensor:
    """The per-token acceptance a whose acceptance rate with k drafts, accepted / drafted =
    mean(a^i for i = 1..k), equals ``rate`` (elementwise bisection; the rate grows with a)."""
    rate = rate.clamp(0.0, 1.0)
    lo, hi = torch.zeros_like(rate), torch.ones_like(rate)
    powers = torch.arange(1, k + 1, dtype=rate.dtype)  # [k]
    for _ in range(40):
        mid = (lo + hi) / 2
        below = (mid[..., None] ** powers).mean(-1) < rate
        lo, hi = torch.where(below, mid, lo), torch.where(below, hi, mid)
    return (lo + hi) / 2


def _interp(xs: torch.Tensor, ys: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear y(x) through the points (xs sorted), the nearest segment's slope outside
    them; flat through a single point."""
    if len(xs) == 1:
        return torch.full_like(x, float(ys[0]))
    i = (torch.searchsorted(xs.contiguous(), x.reshape(-1).contiguous()) - 1).clamp(0, len(xs) - 2).reshape(x.shape)
    return ys[i] + (x - xs[i]) * (ys[i + 1] - ys[i]) / (xs[i + 1] - xs[i])


def step_ms(table: Sequence[Sequence[float]], rows: float, tokens: torch.Tensor | float) -> torch.Tensor:
    """A target forward's ms for ``rows`` rows of ``tokens`` tokens each, read off a measured step
    table [[rows, tokens per row, ms], ...]: linear in the tokens within each measured row count,
    then linear between the two row counts around ``rows``. Outside the measured row counts it
    reads the nearest one (a batch larger than profiled is priced as the largest: measure up to
    the server's max_batch_size)."""
    t = torch.as_tensor(tokens, dtype=torch.float64)
    pts = torch.tensor(table, dtype=torch.float64)  # [P, 3]
    counts = torch.unique(pts[:, 0])  # sorted row counts
    at = []
    for r in counts:
        mine = pts[pts[:, 0] == r]
        mine = mine[mine[:, 1].argsort()]
        at.append(_interp(mine[:, 1], mine[:, 2], t))
    if len(counts) == 1:
        return at[0].float()
    b = min(max(float(rows), float(counts[0])), float(counts[-1]))
    i = min(max(int(torch.searchsorted(counts, torch.tensor([b], dtype=torch.float64))[0]) - 1, 0), len(counts) - 2)
    c0, c1 = float(counts[i]), float(counts[i + 1])
    return (at[i] + (b - c0) * (at[i + 1] - at[i]) / (c1 - c0)).float()


def plan_cap(expected: Sequence[Sequence[float]], fixed: Sequence[bool], cost: Callable[[int], float | None],
             ks: Sequence[int]) -> int | None:  # fmt: skip
    """The K cap of one step that maximises the batch's expected tokens per ms.

    expected[b]: [E_b[0] = 1, E_b[1], ..., E_b[budget_b]], what row b commits if it may propose
        j tokens (a row that does not draft: [1.0]).
    fixed[b]: the row keeps its whole budget (a seeded sampled row); the cap is at least it.
    cost(c): the step's ms when the longest proposal is c tokens (c = 0: a one-token verify);
        None where nothing is known, which rules that c out.
    ks: the K buckets (verify widths - 1) a step can run at.
    Returns the cap (0 or a bucket), or None when no candidate has a cost (leave the rows alone).
    Ties go to the smaller cap: it is the cheaper step for the same tokens.
    """
    ordered = sorted(ks)
    longest = max((len(e) - 1 for e in expected), default=0)
    floor = max((len(e) - 1 for e, f in zip(expected, fixed) if f), default=0)
    top = next((k for k in ordered if k >= longest), longest) if longest else 0  # the uncapped step's bucket
    low = next((k for k in ordered if k >= floor), floor) if floor else 0  # a fixed row's bucket
    candidates = [c for c in (0, *ordered) if low <= c <= top]
    best, best_rate = None, -1.0
    for c in candidates:
        ms = cost(c)
        if ms is None or ms <= 0:
            continue
        tokens = sum(e[len(e) - 1] if f else e[min(c, len(e) - 1)] for e, f in zip(expected, fixed))
        if tokens / ms > best_rate + 1e-12:
            best, best_rate = c, tokens / ms
    return best


class StepCosts:
    """Step times by (rows, verify width), for ``plan_cap``: a moving average of measured steps
    (the engine seeds every shape at load, ``SpeculativeEngine.time_steps``, then adds each step it
    runs), a profiled table (``step_ms``) for a shape not measured yet, and where neither exists the
    nearest narrower shape measured at those rows (optimistic, so the width gets tried and
    measured). The draft models' time per forward is averaged the same way."""

    def __init__(self, table: Sequence[Sequence[float]] | None = None, weight: float = 0.2) -> None:
        self.weight = weight
        self.verify: dict[tuple[int, int], float] = {}  # (rows, width) -> ms
        self.draft_per_forward: dict[int, float] = {}  # rows -> ms of one draft-model forward
        self._table_ms: dict[tuple[int, int], float] = {}  # the table read once per shape
        self.set_table(table)

    def set_table(self, table: Sequence[Sequence[float]] | None) -> None:
        """A profiled step table for the shapes not measured yet (measurements stay)."""
        self.table = [list(map(float, p)) for p in table] if table else None
        self._table_ms.clear()

    def _average(self, store: dict, key, ms: float) -> None:
        old = store.get(key)
        store[key] = ms if old is None else (1 - self.weight) * old + self.weight * ms

    def observe(self, rows: int, width: int, verify_ms: float) -> None:
        """One measured verify of ``width`` tokens per row over ``rows`` rows."""
        self._average(self.verify, (rows, width), verify_ms)

    def observe_draft(self, rows: int, forwards: int, draft_ms: float) -> None:
        """``forwards`` sequential draft-model forwards over a step of ``rows`` rows took ``draft_ms``."""
        if forwards > 0:
            self._average(self.draft_per_forward, rows, draft_ms / forwards)

    def verify_ms(self, rows: int, width: int) -> float | None:
        if (rows, width) in self.verify:
            return self.verify[(rows, width)]
        if self.table:
            if (rows, width) not in self._table_ms:
                self._table_ms[(rows, width)] = float(step_ms(self.table, rows, float(width)))
            return self._table_ms[(rows, width)]
        narrower = [w for (r, w) in self.verify if r == rows and w < width]
        return self.verify[(rows, max(narrower))] if narrower else None

    def step_ms(self, rows: int, cap: int, model_budget: int = 0) -> float | None:
        """A step whose longest proposal is ``cap`` tokens: its verify, plus the draft models'
        forwards (as many as the longest draft-model budget under the cap)."""
        verify = self.verify_ms(rows, cap + 1)
        forwards = min(cap, model_budget)
        if verify is None or not forwards:
            return verify
        return verify + forwards * self.draft_per_forward.get(rows, 0.0)


def expected_from_counts(accepted_at: Sequence[int], drafted_at: Sequence[int], budget: int, prior_a: float,
                         prior_weight: float = 4.0) -> list[float]:  # fmt: skip
    """E[0..budget] for one row from its own record: position i of a proposal survived
    accepted_at[i] of drafted_at[i] times (the chance that the first i + 1 drafts all hold),
    smoothed towards prior_a^(i + 1) with ``prior_weight`` pseudo-steps (the router's prediction,
    or a default, until the row has drafted)."""
    out, total = [1.0], 1.0
    for i in range(budget):
        acc = accepted_at[i] if i < len(accepted_at) else 0
        n = drafted_at[i] if i < len(drafted_at) else 0
        total += (acc + prior_weight * prior_a ** (i + 1)) / (n + prior_weight)
        out.append(total)
    return out


@dataclass(frozen=True)
class RowCosts:
    """One row's decode step priced by its parts, in ms, at one batch size.

    verify: [[width, ms], ...]: the target's forward over ``width`` tokens, with the step's fixed
        host work (sampling, acceptance, bookkeeping) included.
    model: model drafter -> [[width, ms], ...]: one forward of the drafter over ``width`` tokens.
        A chain of k drafts is one forward over the tokens the drafter has not seen yet (1 after a
        step it drafted and that rejected a token, 2 after one it drafted and was accepted in full,
        more after steps it skipped: the catch-up), then k - 1 one-token forwards.
    host: host drafter -> ms per proposal (microseconds, but counted).
    Widths between or beyond the measured ones are read off the piecewise-linear line through them.
    """

    verify: Sequence[Sequence[float]]
    model: Mapping[str, Sequence[Sequence[float]]] = field(default_factory=dict)
    host: Mapping[str, float] = field(default_factory=dict)

    @staticmethod
    def _line(points: Sequence[Sequence[float]], width: float) -> float:
        pts = torch.tensor(sorted(map(tuple, points)), dtype=torch.float64)  # [P, 2]
        return float(_interp(pts[:, 0], pts[:, 1], torch.tensor(float(width), dtype=torch.float64)))

    def verify_ms(self, width: int) -> float:
        return self._line(self.verify, width)

    def draft_ms(self, drafter: str | None, k: int, catch_up: int = 1) -> float:
        """What ``drafter`` costs to propose k tokens; ``catch_up``: the tokens a model drafter
        must read before its first draft (at least 1: the token the last verify committed)."""
        if drafter is None or k <= 0:
            return 0.0
        if drafter in self.model:
            if catch_up < 1:
                raise ValueError(f"catch_up={catch_up}: a model drafter reads at least the last committed token")
            return self._line(self.model[drafter], catch_up) + (k - 1) * self._line(self.model[drafter], 1)
        if drafter in self.host:
            return float(self.host[drafter])
        raise KeyError(f"no cost for drafter {drafter!r}; priced: {', '.join([*self.model, *self.host]) or 'none'}")
