"""Step 1 of the speculative step: every row's drafter proposes, and the proposals become one block.

Per row, by what its drafter declares (``serving.engine.drafters.base``, no switch on classes):

1. a drafter that ``routes`` (``auto``) chooses this step's drafter for the row (``choose``); the
   row then drafts with that one, or with the host tokens the choice already holds, or not at all;
2. a ``host`` drafter proposes from the row's tokens (``propose``): point masses, cheap, so they
   come first and a goodput cap (``KPolicy.cap``) prices what they proposed;
3. every other drafter proposes for all of its rows at once on the device (``propose_rows``), at
   the budgets left after the cap.

The proposals are merged into ``tokens`` [B, K], ``q`` [B, K, V] and ``n`` [B] at the step's K,
the smallest K bucket holding every proposal (a compiled verify width); rows past their own
proposal are padding the acceptance rule masks.

A row whose grammar forces its next tokens (``forced``: a JSON schema's keys, punctuation) still
asks its drafter, then joins the two: the drafter's proposal where it begins with the forced
tokens (it carries on past them), else the forced tokens alone (free drafts). ``Drafts.forced``
marks the rows drafted by the grammar alone: their tokens are counted as the ``grammar``
proposer's, and a routing drafter hears no verdict on a choice it did not draft.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from serving.engine.devices import synchronize
from serving.engine.drafters.base import NONE, DraftBatch, Drafter, Proposal
from serving.engine.engine_settings import EngineConfig
from serving.engine.goodput import StepCosts
from serving.engine.k_policy import KPolicy
from serving.engine.slots import Slot
from serving.engine.speculative import DecodeState, StepRandom

GRAMMAR = "grammar"  # the proposer of a grammar's forced tokens (statistics, token origins, /metrics)


@dataclass
class Drafts:
    """One step's proposals, merged: what the verifier checks and what the step tells the rows."""

    tokens: torch.Tensor  # [B, K] long
    q: torch.Tensor  # [B, K, V] the distributions the tokens were drawn from
    n: torch.Tensor  # [B] long: real draft tokens per row, the rest of K is padding
    budgets: list[int]  # [B] each row's budget after a goodput cap
    proposers: dict[int, str]  # row -> who proposed its tokens when not its own drafter (auto's choice; the grammar: ``forced``)
    routed: set[int]  # rows whose routing drafter (auto) chose this step's drafter: it hears the verdict
    forced: torch.Tensor  # [B] bool: rows whose drafts are the grammar's forced tokens alone
    model_s: float = 0.0  # time of the device drafters' forwards
    forwards: int = 0  # device forwards run
    capped: frozenset[int] = frozenset()  # rows whose budget the goodput cap lowered this step (load)


def distinct(drafters: Mapping[str, Drafter]) -> list[Drafter]:
    """Each drafter once (two names may share one, e.g. two names of one draft model)."""
    return list({id(d): d for d in drafters.values()}.values())


def draft(drafters: Mapping[str, Drafter], slots: Sequence[Slot | None], state: DecodeState, sampling, rand: StepRandom,
          budgets: list[int], policy: KPolicy, step_costs: StepCosts, config: EngineConfig, vocab_size: int,
          device: torch.device, forced: Mapping[int, list[int]] | None = None) -> Drafts:  # fmt: skip
    """Step 1 for every drafter's rows (see the module docstring). ``budgets``: each row's K.
    ``forced``: row -> tokens its grammar forces next: proposed instead of its drafter's (free, and
    never rejected where the grammar allows one token only)."""
    B = len(slots)
    budgets = policy.cap(slots, list(budgets), None, step_costs)  # before proposing: a row capped at 0 proposes nothing
    capped = set(policy.cut)
    host: list[list[int] | None] = [None] * B  # row -> tokens already proposed on the host
    routes: dict[int, Drafter] = {}  # row -> the device drafter that drafts it this step
    proposers: dict[int, str] = {}
    routed: set[int] = set()
    ahead: dict[int, list[int]] = {}  # row -> the tokens its grammar forces next, within its budget
    for b, slot in enumerate(slots):
        drafter = drafters.get(slot.drafter) if slot is not None else None
        if drafter is None:
            continue
        if budgets[b] and forced and forced.get(b):
            ahead[b] = forced[b][: budgets[b]]
        if budgets[b] and drafter.routes:  # auto: this step's drafter for the row
            choice = drafter.choose(b, slot.tokens, budgets[b], slot.request.drafter_priors)
            budgets[b] = choice.k if choice.drafter is not None else 0
            proposers[b] = choice.drafter or NONE
            routed.add(b)
            if choice.tokens is not None:
                host[b] = choice.tokens[: budgets[b]]
            elif choice.drafter is not None:
                drafter = drafters[choice.drafter]
        if budgets[b] and drafter.host and host[b] is None:
            host[b] = drafter.propose(b, slot.tokens, budgets[b])[: budgets[b]]
        if not drafter.host and not drafter.routes:
            routes[b] = drafter
    # Priced again with what each row now proposes: a host proposal's length, a model's forwards.
    budgets = policy.cap(slots, budgets, [None if t is None else len(t) for t in host], step_costs, set(routes))
    capped |= policy.cut
    host = [None if t is None else t[: budgets[b]] for b, t in enumerate(host)]
    alone = [False] * B  # rows drafted by their grammar alone
    for b, f in ahead.items():  # host rows join here, device rows in ``merge``
        if b not in routes and (host[b] or [])[: len(f)] != f:
            host[b], alone[b] = f, True
    proposals = []
    started, forwards = time.perf_counter(), 0
    for drafter in distinct(drafters):
        if drafter.host or drafter.routes:
            continue
        mine = [budgets[b] if routes.get(b) is drafter else 0 for b in range(B)]
        proposal = drafter.propose_rows(DraftBatch(mine, state, sampling, rand, vocab_size, config.batch_buckets,
                                                   config.draft_confidence, config.draft_stop, config.k_max))  # fmt: skip
        if proposal is not None:
            proposals.append((proposal, torch.tensor([m > 0 for m in mine], device=device)))  # [B] its rows
            forwards += proposal.forwards
    if forwards:
        synchronize(device)
    model_s = time.perf_counter() - started
    tokens, q, n, joined = merge([t or [] for t in host], proposals, config.k_buckets, vocab_size, device,
                                 {b: f for b, f in ahead.items() if b in routes})  # fmt: skip
    forced_only = torch.tensor(alone, device=device) | ~joined  # [B]
    return Drafts(tokens, q, n, budgets, proposers, routed, forced_only, model_s, forwards, frozenset(capped))


def merge(host: list[list[int]], proposals: list[tuple[Proposal, torch.Tensor]], k_buckets: Sequence[int], V: int,
          device: torch.device, ahead: Mapping[int, list[int]] | None = None,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The host rows' tokens and each device drafter's proposal for its rows (``mine`` [B]) as one
    block at the step's K: the smallest bucket that holds every proposal. ``ahead``: device rows'
    grammar-forced tokens, kept with the drafter's proposal where it begins with them, else alone
    (returned ``joined`` [B] bool: False where a row's forced tokens replaced its proposal)."""
    B = len(host)
    ahead = ahead or {}
    width = max([*map(len, host), *map(len, ahead.values()), *(p.tokens.shape[1] for p, _ in proposals)])
    k = next((kb for kb in k_buckets if kb >= width), width) if width else 0
    rows = torch.tensor([t + [0] * (k - len(t)) for t in host], dtype=torch.long).reshape(B, k)
    tokens = rows.to(device)  # [B, K]
    n = torch.tensor([len(t) for t in host], dtype=torch.long, device=device)  # [B]
    q = torch.nn.functional.one_hot(tokens, V).float() if any(host) else None  # [B, K, V] point masses
    for p, mine in proposals:
        pad = k - p.tokens.shape[1]
        p_tokens = torch.nn.functional.pad(p.tokens, (0, pad))  # [B, K]
        q_m = torch.nn.functional.pad(p.q, (0, 0, 0, pad))  # [B, K, V]
        tokens = torch.where(mine.unsqueeze(1), p_tokens, tokens)
        n = torch.where(mine, p.n, n)
        if q is None and len(proposals) == 1:
            q = q_m  # the only proposer: rows not its own have n 0, so their q is masked
        else:
            q = torch.where(mine.view(B, 1, 1), q_m, q if q is not None else torch.zeros_like(q_m))
    if q is None:
        q = torch.zeros(B, k, V, device=device)  # [B, K, V] nothing drafted
    joined = torch.ones(B, dtype=torch.bool, device=device)  # [B]
    if ahead:  # on the device: which proposals begin with their row's forced tokens is known after the step's sync
        rows_f = [list(ahead.get(b, ())) for b in range(B)]
        f_n = torch.tensor([len(f) for f in rows_f], device=device)  # [B]
        f_tokens = torch.tensor([f + [0] * (k - len(f)) for f in rows_f], dtype=torch.long, device=device)  # [B, K]
        within = torch.arange(k, device=device) < f_n.unsqueeze(1)  # [B, K]
        joined = ((tokens == f_tokens) | ~within).all(1) & (n >= f_n)  # [B]
        tokens = torch.where(joined.unsqueeze(1), tokens, f_tokens)
        n = torch.where(joined, n, f_n)
        q = torch.where(joined.view(B, 1, 1), q, torch.nn.functional.one_hot(f_tokens, V).to(q.dtype))
    return tokens, q, n, joined
