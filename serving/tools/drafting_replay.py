"""Replay drafters against a known answer: what a single drafter, the per-prompt oracle and a
per-step oracle would cost, without running the target again.

Greedy output does not depend on the drafter, so one decode of the target gives a prompt's answer.
Every drafter's proposal at every position can then be scored against it: at position t (t answer
tokens committed), drafter X proposes ``proposed[X][t]`` tokens of which the first
``accepted[X][t]`` match the answer. A greedy step from t commits ``accepted + 1`` tokens (the
target's correction or bonus), at most what is left. ``RowCosts`` (``serving.engine.goodput``)
prices the step: the drafter's proposal (a model drafter's catch-up included), then the target's
verify at the width the engine would run (the proposal rounded up to a verify width, plus one).

The target's prefill commits the first answer token, so every policy starts at t = 1 with a model
drafter's cache holding the prompt (d = 0 answer tokens). A model drafter that drafts k tokens at t
has read the answer up to t + k - 1; the accepted part stays, so its cache holds
d = t + min(accepted, k - 1) answer tokens afterwards, and the next time it drafts it first reads the
t - d tokens it has not seen (one forward: the catch-up).

* ``single``: one drafter on every step (``None``: the target alone).
* ``per_step_greedy``: at each step, the drafter (or none) whose step commits the most tokens per ms.
* ``per_step_best``: the cheapest sequence of per-step choices to the end of the answer (dynamic
  programming over (t, d)): an upper bound for any policy that picks one drafter per step at these
  proposal lengths, since it knows every acceptance in advance.
* ``policy``: ``auto``'s own policy (``serving.engine.drafters.auto.HybridPolicy``), knowing only
  what it would know live: each step's host proposal lengths, the model drafter's gap, and the
  scores of earlier steps (a host proposal is scored once the answer so far decides it, the model
  drafter on the steps it drafted).

A policy that drafts with a model drafter at all also pays that drafter's prefill of the prompt.
Pure functions over lists: ``scripts/experiments/replay_ceiling.py`` measures the traces and costs.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

from serving.engine.drafters.auto import HybridPolicy, host_key
from serving.engine.goodput import RowCosts


@dataclass(frozen=True)
class Trace:
    """One prompt's answer as every drafter saw it.

    answer_len: T, the answer's tokens (the first one comes from the target's prefill).
    proposed, accepted: drafter -> [T] per position t (only t >= 1 is read): the proposal's length
        and its prefix that matches the answer (accepted <= proposed).
    prefill_ms: the target's prefill of the prompt; model_prefill_ms: each model drafter's.
    """

    answer_len: int
    proposed: dict[str, list[int]]
    accepted: dict[str, list[int]]
    prefill_ms: float = 0.0
    model_prefill_ms: dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in self.proposed:
            p, a = self.proposed[name], self.accepted.get(name)
            if a is None or len(p) != self.answer_len or len(a) != self.answer_len:
                raise ValueError(f"drafter {name!r}: need {self.answer_len} proposal and acceptance lengths, "
                                 f"got {len(p)} and {None if a is None else len(a)}")  # fmt: skip
            if any(not 0 <= x <= y for x, y in zip(a, p)):
                raise ValueError(f"drafter {name!r}: an acceptance outside 0..proposed")


@dataclass(frozen=True)
class Outcome:
    ms: float  # prefill plus every step
    steps: int  # target calls after the prefill
    choices: dict[str, int]  # drafter ("none" for the target alone) -> steps it drafted


def verify_width(n: int, widths: Sequence[int]) -> int:
    """The target's input width for a proposal of n tokens: the smallest verify width that holds
    n + 1 (the engine pads a short proposal up to a bucket)."""
    i = bisect_left(sorted(widths), n + 1)
    if i == len(widths):
        raise ValueError(f"a proposal of {n} tokens fits no verify width of {sorted(widths)}")
    return sorted(widths)[i]


class Replay:
    """One trace under one cost model. ``widths``: the engine's verify widths; ``k``: the model
    drafters' chain length (host drafters propose what their trace says)."""

    def __init__(self, trace: Trace, costs: RowCosts, widths: Sequence[int], k: int) -> None:
        self.trace, self.costs, self.widths, self.k = trace, costs, tuple(sorted(widths)), k
        self.models = [d for d in trace.proposed if d in costs.model]
        self.hosts = [d for d in trace.proposed if d not in costs.model]
        if len(self.models) > 1:
            raise ValueError(f"the per-step search tracks one model drafter's cache; got {self.models}")
        self._ms: dict[tuple, float] = {}  # the search prices the same few shapes many times

    def _priced(self, key: tuple, price) -> float:
        if key not in self._ms:
            self._ms[key] = price()
        return self._ms[key]

    def step(self, drafter: str | None, t: int, d: int) -> tuple[float, int, int]:
        """(ms, next t, next d) of one step from position t, d the model drafter's cache."""
        T, tr = self.trace.answer_len, self.trace
        if drafter is None:
            return self._priced(("verify", 1), lambda: self.costs.verify_ms(1)), t + 1, d
        n, a = tr.proposed[drafter][t], tr.accepted[drafter][t]
        if drafter in self.models:
            n, catch_up = self.k, t - d  # a model drafter always drafts its chain
            ms = self._priced((drafter, n, catch_up), lambda: self.costs.draft_ms(drafter, n, catch_up=catch_up))
            d = t + min(a, n - 1)
        else:
            ms = self._priced((drafter, n), lambda: self.costs.draft_ms(drafter, n))
        width = verify_width(n, self.widths)
        return ms + self._priced(("verify", width), lambda: self.costs.verify_ms(width)), min(t + a + 1, T), d

    def _start(self, uses_model: bool) -> float:
        model_prefill = sum(self.trace.model_prefill_ms.get(m, 0.0) for m in self.models) if uses_model else 0.0
        return self.trace.prefill_ms + model_prefill

    def _walk(self, choose) -> Outcome:
        t, d, ms, steps, used = 1, 0, 0.0, 0, {}
        while t < self.trace.answer_len:
            drafter = choose(t, d)
            step_ms, t, d = self.step(drafter, t, d)
            ms, steps = ms + step_ms, steps + 1
            used[drafter or "none"] = used.get(drafter or "none", 0) + 1
        return Outcome(self._start(any(m in used for m in self.models)) + ms, steps, used)

    def single(self, drafter: str | None) -> Outcome:
        return self._walk(lambda t, d: drafter)

    def per_step_greedy(self) -> Outcome:
        """Each step, the option that commits the most tokens per ms of that step."""
        options = [None, *self.hosts, *self.models]

        def choose(t: int, d: int) -> str | None:
            def rate(x):
                ms, t2, _ = self.step(x, t, d)
                return (t2 - t) / ms

            return max(options, key=rate)  # ties: the first, the target alone before any drafter

        return self._walk(choose)

    def per_step_best(self) -> Outcome:
        """The cheapest per-step choices to the answer's end, with and without the model drafter
        (which alone costs its prefill)."""
        best = min((self._search(with_model) for with_model in ((False, True) if self.models else (False,))),
                   key=lambda o: o.ms)  # fmt: skip
        return best

    def _search(self, with_model: bool) -> Outcome:
        """Backward over positions: best[t][d] is the least ms from position t, the model drafter's
        cache at d < t (always 0 without it), to the end; every step moves t forward."""
        options = [None, *self.hosts, *(self.models if with_model else [])]
        T = self.trace.answer_len
        best: list[list[tuple[float, str | None]]] = [[] for _ in range(T + 1)]
        best[T] = [(0.0, None)] * (T + 1)

        def rest(t: int, d: int) -> float:
            return best[t][d if with_model else 0][0] if t < T else 0.0

        for t in range(T - 1, 0, -1):
            row = []
            for d in range(t if with_model else 1):
                found = None
                for x in options:
                    ms, t2, d2 = self.step(x, t, d)
                    total = ms + rest(t2, d2)
                    if found is None or total < found[0] - 1e-12:  # ties: the earlier option
                        found = (total, x)
                row.append(found)
            best[t] = row
        t, d, used, steps = 1, 0, {}, 0
        while t < T:
            x = best[t][d if with_model else 0][1]
            _, t, d = self.step(x, t, d)
            used[x or "none"] = used.get(x or "none", 0) + 1
            steps += 1
        total = best[1][0][0] if T > 1 else 0.0
        return Outcome(self._start(any(m in used for m in self.models)) + total, steps, used)

    def policy(self, policy: HybridPolicy, budget: int | None = None) -> Outcome:
        """``auto``'s policy walked over the trace (``budget``: the row's K, default the replay's k)."""
        budget = budget or self.k
        tr, T = self.trace, self.trace.answer_len
        scores, pending = policy.scores(), []  # pending: (drafter, position, proposed, accepted), undecided yet
        t, d, ms, steps, used = 1, 0, 0.0, 0, {}
        while t < T:
            hosts = {h: [0] * min(tr.proposed[h][t], budget) for h in self.hosts if tr.proposed[h][t]}
            for h, tokens in hosts.items():
                pending.append((h, t, len(tokens), min(tr.accepted[h][t], len(tokens))))
            choice = policy.choose(scores, budget, hosts, {m: t - d - 1 for m in self.models})
            name, k = choice.drafter, choice.k
            if name is None:
                step_ms, a = self.costs.verify_ms(verify_width(0, self.widths)), 0
            elif name in self.models:
                a = min(tr.accepted[name][t], k)
                step_ms = self.costs.draft_ms(name, k, catch_up=t - d) + self.costs.verify_ms(verify_width(k, self.widths))
                scores.add(name, k, a)
                d = t + min(a, k - 1)
            else:
                a = min(tr.accepted[name][t], k)
                step_ms = self.costs.draft_ms(name, k) + self.costs.verify_ms(verify_width(k, self.widths))
            t = min(t + a + 1, T)
            ms, steps = ms + step_ms, steps + 1
            used[name or "none"] = used.get(name or "none", 0) + 1
            left = []
            for h, at, n, acc in pending:  # decided at its first mismatch, or once all of it is committed
                if t >= at + min(acc + 1, n) or t >= T:
                    scores.add(h, n, acc, key=host_key(h, n))
                else:
                    left.append((h, at, n, acc))
            pending = left
        return Outcome(self._start(any(m in used for m in self.models)) + ms, steps, used)
