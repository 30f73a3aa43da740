"""``auto``: a drafter per row and step, the one with the best expected tokens per ms.

A request is not one kind of text: a code edit copies long spans of its input and writes new
lines between them. ``auto`` keeps every other drafter of the engine on each of its rows and,
each step, proposes from the one whose step is expected to commit the most tokens per ms:

1. **Scores** (``Scores``): before each choice, every host drafter's (``ngram``, ``suffix``,
   ``prediction``) earlier proposals for the row are scored against the tokens the target
   committed since (a proposal longer than the committed tokens waits for later steps to settle
   its tail). A model drafter is scored on the steps it ran. A row's record per drafter is its
   per-token acceptance (accepted of tested tokens), smoothed towards a prior (the router's
   prediction, or ``prior_a``); the geometric model turns it into tokens per step.
2. **Policy** (``HybridPolicy.choose``, a pure function): the options are the target alone, each
   host proposal (its length known: it was just made) cut to any k, and each model drafter at any k
   up to the budget. Each is priced by ``RowCosts``: the verify at the width the step would run, the
   drafter's proposal, a model drafter's catch-up over the tokens it skipped, and, for an option
   that leaves a model drafter behind, the catch-up its tokens will cost that drafter later
   (``catch_up_weight``). The choice reads host proposals (deterministic given the row's tokens) and
   the row's own record only, never a token a model drafter sampled this step: the proposal used
   is then distributed as its q, and the acceptance rule stays exact.
3. The engine asks ``choose`` per row (``RoutingDrafter``), routes a model choice to that
   drafter's ``propose_rows`` and reports the verdict (``settle``). What ``choose`` changes is
   provisional (the drafter protocol's rule): this step's host proposals join the scores, and a
   model drafter started for the row counts as started, in ``observe``, once the step committed; a
   step that failed and is asked again starts from the row's committed record.

The costs are frozen when the engine prices the drafter (``price``): a seeded request's choices
then depend on its own tokens only, never on what else shares the batch. The same policy and
scores replay over recorded traces (``serving.tools.drafting_replay.Replay.policy``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serving.engine.drafters.base import Choice, Drafter, HostDrafter, RoutingDrafter, RowContext

if TYPE_CHECKING:  # the settings import this module, and must not pull in torch
    from serving.engine.goodput import RowCosts

NONE_CHOICE = Choice(None, 0)


@dataclass
class Record:
    """One drafter's record on one row: of ``trials`` proposed tokens that were tested (a proposal
    is tested up to its first rejection), ``hits`` were accepted. Pooled over positions, so a few
    short proposals still tell what a long one would do (per-token acceptance, the geometric
    model of Leviathan et al. 2023)."""

    hits: float = 0.0
    trials: float = 0.0

    def add(self, proposed: int, accepted: int) -> None:
        self.hits += accepted
        self.trials += min(accepted + 1, proposed)

    def acceptance(self, prior: float, weight: float) -> float:
        """Per-token acceptance, smoothed towards ``prior`` with ``weight`` pseudo-trials."""
        return (self.hits + weight * prior) / (self.trials + weight)


class Scores:
    """One row's records, per drafter, with the host proposals still waiting for their tokens."""

    def __init__(self) -> None:
        self.records: dict[str, Record] = {}
        self.pending: list[tuple[str, int, list[int]]] = []  # (drafter, position of its first token, tokens)

    def record(self, drafter: str) -> Record:
        return self.records.setdefault(drafter, Record())

    def add(self, drafter: str, proposed: int, accepted: int, key: str | None = None) -> None:
        """One verdict on ``drafter``'s proposal, kept under ``key`` (default the drafter's name)."""
        self.record(key or drafter).add(proposed, accepted)

    def propose(self, drafter: str, at: int, tokens: Sequence[int]) -> None:
        """``drafter`` would propose ``tokens`` for positions ``at``, ``at + 1``, ... (an empty
        proposal scores nothing)."""
        if tokens:
            self.pending.append((drafter, at, list(tokens)))

    def settle(self, committed: Sequence[int]) -> None:
        """Score every pending proposal that ``committed`` (the row's tokens so far) decides: it
        is decided at its first mismatch, or once every token of it is committed."""
        left = []
        for drafter, at, tokens in self.pending:
            known = committed[at : at + len(tokens)]
            n = 0
            while n < len(known) and known[n] == tokens[n]:
                n += 1
            if n < len(known) or n == len(tokens):
                self.add(drafter, len(tokens), n, key=host_key(drafter, len(tokens)))
            else:
                left.append((drafter, at, tokens))
        self.pending = left


def host_key(drafter: str, proposed: int) -> str:
    """A host drafter's record is kept per proposal length: a copy drafter proposes long when its
    match is long (``suffix``: when its branch frequencies are high), and a long match holds far
    more often than a one-token one."""
    return f"{drafter}@{proposed}"


@dataclass(frozen=True)
class HybridPolicy:
    """The choice of one step for one row. ``costs``: the row's step priced by parts (batch 1);
    ``widths``: the verify widths a step can run at; ``prior_a``: drafter -> the per-token
    acceptance assumed before the row's own record (``default_prior`` for the others);
    ``prior_weight``: pseudo-steps of that prior; ``catch_up_weight``: how much of the catch-up a
    step's tokens will cost a model drafter that skips it is charged to that step (0: none, the
    per-step greedy rule; 1: all, as if the model drafter surely drafts again)."""

    costs: RowCosts
    widths: tuple[int, ...]
    prior_a: Mapping[str, float] = field(default_factory=dict)
    default_prior: float = 0.5
    prior_weight: float = 4.0
    catch_up_weight: float = 0.5
    _ms: dict = field(default_factory=dict, compare=False, repr=False)  # the few shapes priced, memoised

    def scores(self) -> Scores:
        """A new row's record."""
        return Scores()

    def _verify(self, k: int) -> float:
        if ("verify", k) not in self._ms:
            width = next((w for w in sorted(self.widths) if w >= k + 1), None)
            if width is None:
                raise ValueError(f"a proposal of {k} tokens fits no verify width of {sorted(self.widths)}")
            self._ms[("verify", k)] = self.costs.verify_ms(width)
        return self._ms[("verify", k)]

    def _draft(self, drafter: str, k: int, catch_up: int = 1) -> float:
        key = (drafter, k, catch_up)
        if key not in self._ms:
            self._ms[key] = self.costs.draft_ms(drafter, k, catch_up=catch_up)
        return self._ms[key]

    def prior(self, key: str, prior: Mapping[str, float] | None = None) -> float:
        """The prior of a record key: the request's own (the router's), else ``prior_a`` for the key
        (``suffix@1``), else for its drafter (``suffix``), else ``default_prior``."""
        for table in (prior or {}, self.prior_a):
            for name in (key, key.split("@")[0]):
                if name in table:
                    return table[name]
        return self.default_prior

    def expected(self, scores: Scores, key: str, k: int, prior: Mapping[str, float] | None = None) -> list[float]:
        """E[0..k]: what a proposal of j tokens is expected to commit, by the record ``key``."""
        rec = scores.records.get(key) or Record()
        a = rec.acceptance(self.prior(key, prior), self.prior_weight)
        out, term = [1.0], 1.0  # expected_tokens(a, j) = 1 + a + ... + a^j, in plain floats (per row and step)
        for _ in range(k):
            term *= a
            out.append(out[-1] + term)
        return out

    def _left_behind(self, gaps: Mapping[str, int], tokens: float) -> float:
        """The catch-up ``tokens`` more committed tokens will cost the model drafters, charged now."""
        if not self.catch_up_weight:
            return 0.0
        extra = 0.0
        for m, gap in gaps.items():
            before = self._draft(m, 1, gap + 1)
            extra += self._draft(m, 1, gap + 1 + round(tokens)) - before
        return self.catch_up_weight * extra

    def choose(self, scores: Scores, budget: int, hosts: Mapping[str, Sequence[int]], gaps: Mapping[str, int],
               prior: Mapping[str, float] | None = None) -> Choice:  # fmt: skip
        """This step's choice: ``hosts`` each host drafter's proposal now, ``gaps`` each model
        drafter's tokens to catch up, ``budget`` the row's K, ``prior`` the request's own priors
        (the router's). Ties go to the cheaper option, the target alone first."""
        best, best_rate = NONE_CHOICE, 1.0 / (self._verify(0) + self._left_behind(gaps, 1.0))
        if budget <= 0:
            return best
        for name, tokens in hosts.items():
            e = self.expected(scores, host_key(name, min(len(tokens), budget)), min(len(tokens), budget), prior)
            for k in range(1, len(e)):
                ms = self._draft(name, k) + self._verify(k) + self._left_behind(gaps, e[k])
                if e[k] / ms > best_rate * (1 + 1e-9):
                    best, best_rate = Choice(name, k, list(tokens[:k])), e[k] / ms
        for name, gap in gaps.items():
            e = self.expected(scores, name, budget, prior)
            others = {m: g for m, g in gaps.items() if m != name}
            for k in range(1, budget + 1):
                ms = self._draft(name, k, gap + 1) + self._verify(k) + self._left_behind(others, e[k])
                if e[k] / ms > best_rate * (1 + 1e-9):
                    best, best_rate = Choice(name, k), e[k] / ms
        return best


class AutoDrafter(RoutingDrafter):
    """The ``auto`` drafter: ``HybridPolicy`` over the engine's other drafters (``components``:
    their names, default all), scored per row by ``Scores``."""

    kind = "auto"

    def __init__(self, components: Sequence[str] | None = None, *, k: int | None = None,
                 prior_a: Mapping[str, float] | None = None, default_prior: float = 0.5, prior_weight: float = 4.0,
                 catch_up_weight: float = 0.5, costs: RowCosts | None = None) -> None:  # fmt: skip
        self.k = k
        self.wanted = tuple(components) if components else None
        self.options = dict(prior_a=dict(prior_a or {}), default_prior=default_prior, prior_weight=prior_weight,
                            catch_up_weight=catch_up_weight)  # fmt: skip
        self.costs = costs
        self.policy: HybridPolicy | None = None
        self.hosts: dict[str, HostDrafter] = {}
        self.models: dict[str, Drafter] = {}
        self._rows: dict[int, _Row] = {}
        self.host_s = 0.0  # time spent choosing and scoring on the host (the host proposals included)

    # ---- set up by the engine ------------------------------------------------------------------

    def attach(self, drafters: Mapping[str, Drafter]) -> None:
        given = {n: d for n, d in drafters.items() if d is not self and not isinstance(d, RoutingDrafter)}
        # auto prices host drafters and draft models (their catch-up after skipped steps); an EAGLE-3
        # head is not among its choices yet.
        unpriced = [n for n, d in given.items() if not isinstance(d, HostDrafter) and d.kind != "model"]
        if self.wanted and (bad := [n for n in self.wanted if n in unpriced]):
            raise ValueError(f"auto: drafters {bad} are {given[bad[0]].kind} drafters, which auto does not choose among "
                             "(it prices host drafters and draft models): leave them out of engine.auto.drafters")  # fmt: skip
        given = {n: d for n, d in given.items() if n not in unpriced}
        names = self.wanted or tuple(given)
        missing = [n for n in names if n not in given]
        if missing:
            raise ValueError(f"auto: drafters {missing} are not drafters of this engine (it has {', '.join(given)}); "
                             "set engine.auto.drafters to some of those")  # fmt: skip
        distinct: dict[int, str] = {}
        for n in names:
            d = given[n]
            if id(d) in distinct:  # two names of one model: score it once
                continue
            distinct[id(d)] = n
            (self.hosts if isinstance(d, HostDrafter) else self.models)[n] = d

    def price(self, costs: RowCosts, widths: Sequence[int]) -> None:
        """Freeze the cost model (the engine's measured one, unless the drafter was given one)."""
        costs = self.costs or costs
        self.policy = HybridPolicy(costs, tuple(widths), **self.options)

    @property
    def model_costs_needed(self) -> tuple[str, ...]:
        return tuple(self.models)

    # ---- per row -------------------------------------------------------------------------------

    def start(self, row: int, ctx: RowContext) -> None:
        hosts = [n for n, d in self.hosts.items() if n != "prediction" or ctx.prediction]
        for n in hosts:
            self.hosts[n].start(row, ctx)
        # A model drafter starts (prefills the prompt) the first time the row chooses it.
        self._rows[row] = _Row(hosts, self.policy.scores(), ctx)

    def choose(self, row: int, tokens: Sequence[int], k: int, prior: Mapping[str, float] | None = None) -> Choice:
        started = time.perf_counter()
        state = self._rows[row]
        self._discard(row, state)  # a choice whose step never committed (it failed): asked again now
        state.scores.settle(tokens)  # the proposals the tokens committed so far decide
        at = len(tokens)
        proposals = {}
        for n in state.hosts:
            proposal = self.hosts[n].propose(row, tokens, k)[:k] if k > 0 else []
            proposals[n] = proposal
            state.proposed.append((n, at, proposal))  # scored whatever is chosen, once the step commits
        # A model drafter not started yet prefills the prompt, then catches up on the answer so far:
        # priced by that catch-up alone, as the replay prices it (the prefill is paid once per request).
        answer = at - len(state.ctx.prompt)
        gaps = {n: d.gap(row) if n in state.started else max(answer - 1, 0) for n, d in self.models.items()}
        choice = self.policy.choose(state.scores, k, {n: p for n, p in proposals.items() if p}, gaps, prior)
        if choice.drafter in self.models and choice.drafter not in state.started:
            model = self.models[choice.drafter]
            model.start(row, state.ctx)  # the prompt's prefill, then the answer so far as a catch-up
            model.observe(row, tokens[len(state.ctx.prompt):])
            state.starting.add(choice.drafter)
        state.last = choice
        self.host_s += time.perf_counter() - started
        return choice

    def settle(self, row: int, drafted: int, accepted: int) -> None:
        """The verdict on this step's choice: a model drafter's proposal is scored here (a host
        drafter's by the tokens, in ``observe``)."""
        state = self._rows[row]
        choice = state.last
        if choice.drafter in self.models and drafted:
            state.scores.add(choice.drafter, drafted, accepted)

    def observe(self, row: int, new_tokens: Sequence[int], hidden=None) -> None:
        started = time.perf_counter()
        state = self._rows[row]
        for name, at, proposal in state.proposed:  # the step committed: its choice is the row's
            state.scores.propose(name, at, proposal)
        state.started |= state.starting
        state.proposed, state.starting = [], set()
        for n in state.hosts:
            self.hosts[n].observe(row, new_tokens)
        for n in state.started:
            self.models[n].observe(row, new_tokens)
        self.host_s += time.perf_counter() - started

    def stop(self, row: int, finished: bool) -> None:
        state = self._rows.pop(row, None)
        if state is None:
            return
        for n in state.hosts:
            self.hosts[n].stop(row, finished)
        for n in state.started | state.starting:
            self.models[n].stop(row, finished)

    def _discard(self, row: int, state: _Row) -> None:
        """Forget a choice whose step never committed: its host proposals, and a model drafter it
        started (stopped again, so the row's next start of it is a first one)."""
        for n in state.starting:
            self.models[n].stop(row, finished=False)
        state.proposed, state.starting = [], set()

    def scores(self, row: int) -> Scores:
        return self._rows[row].scores


@dataclass
class _Row:
    hosts: list[str]  # the host drafters this row uses (prediction only with a prediction)
    scores: Scores
    ctx: RowContext
    started: set[str] = field(default_factory=set)  # the model drafters that hold this row
    last: Choice = NONE_CHOICE
    # This step's choice until the step commits (observe): host proposals and a model started for it
    proposed: list[tuple[str, int, list[int]]] = field(default_factory=list)
    starting: set[str] = field(default_factory=set)
