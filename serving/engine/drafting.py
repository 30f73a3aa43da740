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
    proposers: dict[int, str]  # row -> who proposed its tokens when not its own drafter ("grammar", or auto's choice)
    routed: set[int]  # rows whose routing drafter (auto) chose this step's drafter: it hears the verdict
    model_s: float = 0.0  # time of the device drafters' forwards
    forwards: int = 0  # device forwards run


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
    host: list[list[int] | None] = [None] * B  # row -> tokens already proposed on the host
    routes: dict[int, Drafter] = {}  # row -> the device drafter that drafts it this step
    proposers: dict[int, str] = {}
    routed: set[int] = set()
    for b, slot in enumerate(slots):
        drafter = drafters.get(slot.drafter) if slot is not None else None
        if drafter is None:
            continue
        if budgets[b] and forced and forced.get(b):  # the grammar's forced tokens: the row's drafter sits this step out
            host[b], proposers[b] = forced[b][: budgets[b]], GRAMMAR
            continue
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
    budgets = policy.cap(slots, budgets, [None if t is None else len(t) for t in host], step_costs)
    host = [None if t is None else t[: budgets[b]] for b, t in enumerate(host)]
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
    tokens, q, n = merge([t or [] for t in host], proposals, config.k_buckets, vocab_size, device)
    return Drafts(tokens, q, n, budgets, proposers, routed, model_s, forwards)


def merge(host: list[list[int]], proposals: list[tuple[Proposal, torch.Tensor]], k_buckets: Sequence[int], V: int,
          device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """The host rows' tokens and each device drafter's proposal for its rows (``mine`` [B]) as one
    block at the step's K: the smallest bucket that holds every proposal."""
    B = len(host)
    width = max([*map(len, host), *(p.tokens.shape[1] for p, _ in proposals)])
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
    return tokens, q, n
