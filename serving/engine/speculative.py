"""One speculative decoding step for a static batch: draft K, verify once, accept/reject, commit.

Per row, with n committed tokens x_0..x_{n-1}: the target's cache holds positions 0..n-2 and the
draft's at least 0..n-3; x_{n-1} is the input of this step. Rows accept different numbers of
tokens, finish on their own, and keep running (frozen) once done, so no shape ever changes.
K = 0 (or no draft) is the target-only decoder: the same step, one token per target call.

The step has two halves that run on different machines in distributed serving: ``draft_half``
(the draft node: K tokens and their q) and ``verify_half`` (the target: ``verify_tokens``, one
forward over [x_{n-1}, drafts] and accept/reject, then ``commit``). The engine, whatever verifies
for it (``serving.engine.verifier``), applies the answer (accepted count, next token) to its own
state with the same ``commit``, so both sides hold the same tokens. ``prefill_first_token`` and
``start_row`` admit a request into a slot, again on either side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from serving.engine.acceptance import accept_reject, threshold_accepts
from serving.engine.processors import first_rows, process
from serving.engine.runner import ModelRunner
from serving.engine.sampling import SamplingParams, SamplingTensors, probs_from_logits, sample


@dataclass
class DecodeState:
    """Device-side state of a batch of B slots; every tensor keeps its shape for the whole run."""

    tokens: torch.Tensor  # [B, S + K_max + 1] long: committed tokens; past each length, stale
    lengths: torch.Tensor  # [B] long: committed tokens n (prompt + generated)
    limits: torch.Tensor  # [B] long: length at which a row stops (prompt + max new tokens)
    done: torch.Tensor  # [B] bool: finished rows stay in the batch, frozen
    eos_ids: torch.Tensor  # [E] long

    def rows(self, index: torch.Tensor) -> "DecodeState":
        """A copy of rows ``index`` ([n] long), in that order (a draft model's own rows)."""
        return DecodeState(self.tokens[index], self.lengths[index], self.limits[index], self.done[index], self.eos_ids)

    def head(self, rows: int) -> "DecodeState":
        """The first ``rows`` rows as views, so every write lands in the whole (a step at a
        smaller batch bucket; made per step, so they always view the current tensors)."""
        if rows == self.lengths.shape[0]:
            return self
        return DecodeState(self.tokens[:rows], self.lengths[:rows], self.limits[:rows], self.done[:rows], self.eos_ids)


@dataclass
class StepRandom:
    """Uniforms for one step, drawn on the host from each request's own generator."""

    draft: torch.Tensor  # [B, K] draws for the draft tokens
    accept: torch.Tensor  # [B, K] accept tests
    next: torch.Tensor  # [B] residual or bonus draw

    def rows(self, index: torch.Tensor) -> "StepRandom":
        return StepRandom(self.draft[index], self.accept[index], self.next[index])


def speculative_step(
    target: ModelRunner,
    draft: ModelRunner | None,
    state: DecodeState,
    sampling: SamplingTensors,
    rand: StepRandom,
    k: int,
    clock: Callable[[str], None] | None = None,
    draft_confidence: float | None = None,
    draft_stop: str = "token",
    k_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Advance every row by one target call. Mutates ``state`` (tokens, lengths, done) in place and
    returns (n_accepted [B], n_new [B], k): draft tokens accepted, tokens committed this step
    (accepted + 1 correction or bonus token, cut at EOS and at the row's limit, 0 if done), and
    how many tokens were drafted (k, or fewer after a ``draft_confidence`` stop).

    ``clock(phase)``, if given, is called after the draft and after the verification, for timing;
    leave it None to compile the whole step into one graph.

    ``draft_confidence``: a row stops drafting once its draft is less sure than this (its top
    probability), as transformers' assisted generation does; the step's drafting ends when no row
    drafts any more and the verification covers the shorter block. It reads a flag back after
    each draft token, so it is meant for CPUs, where that costs nothing; leave it None for one
    host sync per step and a single compiled graph. ``draft_stop="cumulative"`` compares the
    running product of those probabilities instead.
    ``k_rows`` ([B] long, each <= k): a per-row draft budget (each request's own K); None: k for all.
    """
    draft_tokens, q, n_draft = draft_half(draft, state, sampling, rand, k, target.vocab_size, draft_confidence,
                                          draft_stop, k_rows)  # fmt: skip
    if clock is not None:
        clock("draft")
    n_accepted, _, n_new = verify_half(target, state, sampling, rand, draft_tokens, q, n_draft, clock)
    return n_accepted, n_new, draft_tokens.shape[1]


def draft_half(
    draft: ModelRunner | None,
    state: DecodeState,
    sampling: SamplingTensors,
    rand: StepRandom,
    k: int,
    vocab_size: int,
    draft_confidence: float | None = None,
    draft_stop: str = "token",
    k_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step 1: draft up to k tokens per row. Returns (draft_tokens [B, K] long, q [B, K, V],
    n_draft [B] long): K = k, fewer once every row has stopped (``draft_confidence``), 0 without a
    draft; ``n_draft`` counts each row's real draft tokens, the rest of its K are padding that
    ``accept_reject`` masks. A row drafts at most its ``k_rows`` budget, and stops after a token
    whose draft distribution is unsure ("token": that distribution's top probability is below
    ``draft_confidence``, transformers' rule; "cumulative": the product of the top probabilities
    so far, a proxy for the chance the whole block survives). Both rules look only at the
    distributions, never at which token was drawn from them: a stop that depends on the drawn
    token would bias sampled output. A row's stop never depends on the other rows. Reads
    ``state``, writes only the draft's cache."""
    B = state.lengths.shape[0]
    n = state.lengths  # [B]
    budget = torch.full_like(n, k) if k_rows is None else k_rows  # [B]
    n_draft = torch.zeros_like(n)  # [B]
    drafting = budget > 0  # [B] rows still drafting
    # The first call re-feeds x_{n-2} too: after a step in which all K were accepted the draft
    # never saw its own last token, and always feeding two keeps the shape fixed instead of
    # branching on the host.
    drafted, q = [], []
    if k > 0 and draft is not None:
        pos = torch.stack([n - 2, n - 1], dim=1)  # [B, 2]
        logits = draft.forward(state.tokens.gather(1, pos), pos, last_only=True)  # [B, 1, V]
        for i in range(k):
            if i > 0:  # last_only as in the first call: one compiled signature per width, warmed up at load
                logits = draft.forward(drafted[-1].unsqueeze(1), (n - 1 + i).unsqueeze(1), last_only=True)  # [B, 1, V]
            q_i = probs_from_logits(logits, sampling)[:, 0]  # [B, V]
            drafted.append(sample(q_i, rand.draft[:, i]))  # [B]
            q.append(q_i)
            n_draft = n_draft + drafting.long()
            drafting = drafting & (budget > i + 1)
            if draft_confidence is not None and i + 1 < k:
                top = torch.softmax(logits[:, 0].float(), -1).amax(-1)  # [B]
                sure = top if draft_stop == "token" else (sure * top if i > 0 else top)  # [B]
                drafting = drafting & (sure >= draft_confidence)
                if not bool((drafting & ~state.done).any()):
                    break
    draft_tokens = torch.stack(drafted, 1) if drafted else n.new_zeros(B, 0)  # [B, K]
    q_all = torch.stack(q, 1) if q else torch.zeros(B, 0, vocab_size, device=n.device)  # [B, K, V]
    return draft_tokens, q_all, n_draft  # n_draft <= K: it grows once per loop pass at most


def verify_logits(
    target: ModelRunner,
    state: DecodeState,
    sampling: SamplingTensors,
    draft_tokens: torch.Tensor,  # [B, K] long
    n_draft: torch.Tensor | None = None,  # [B] long: real draft tokens per row (None: all K)
) -> torch.Tensor:
    """Step 2: one target forward over [x_{n-1}, drafts]; returns the logits of the K+1 verified
    positions [B, K+1, V] (fp32), processed by the rows' logits processors, each position with the
    drafts before it in its history (``serving.engine.processors``). Writes only the target's cache."""
    k = draft_tokens.shape[1]
    n = state.lengths  # [B]
    current = state.tokens.gather(1, (n - 1).unsqueeze(1))  # [B, 1] x_{n-1}
    verify_in = torch.cat([current, draft_tokens], dim=1)  # [B, K+1]
    verify_pos = (n - 1).unsqueeze(1) + torch.arange(k + 1, device=n.device)  # [B, K+1]
    # A done (frozen) row still runs through the forward; it may have reserved room for a smaller
    # K than this step's (a session of another K on a shared target), so keep its writes inside
    # the cache. Everything at or past its n-1 is stale to it and rewritten before it is read.
    verify_pos = torch.where(state.done.unsqueeze(1), verify_pos.clamp(max=target.max_len - 1), verify_pos)
    logits = target.forward(verify_in, verify_pos).float()  # [B, K+1, V]
    if sampling.processors is not None:
        logits = process(logits, sampling.processors, draft_tokens, n_draft)
    return logits


def accept_logits(
    logits: torch.Tensor,  # [B, K+1, V] the verified positions' processed logits
    sampling: SamplingTensors,
    rand: StepRandom,
    draft_tokens: torch.Tensor,  # [B, K] long
    q: torch.Tensor,  # [B, K, V] the distributions the draft tokens were sampled from
    n_draft: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 3: p from the logits under each row's sampling settings, then accept/reject (Leviathan
    et al. 2023); returns (n_accepted [B], next_token [B]), the correction or bonus token."""
    k = draft_tokens.shape[1]
    p = probs_from_logits(logits, sampling)  # [B, K+1, V]
    lossy = None
    if sampling.lossy:  # only batches holding a threshold row compute it (its own, plain softmax)
        lossy = threshold_accepts(logits[:, :k].softmax(-1), draft_tokens, sampling.threshold)  # [B, K]
    return accept_reject(p, q, draft_tokens, rand.accept[:, :k], rand.next, n_draft, lossy)


def verify_tokens(
    target: ModelRunner,
    state: DecodeState,
    sampling: SamplingTensors,
    rand: StepRandom,
    draft_tokens: torch.Tensor,  # [B, K] long
    q: torch.Tensor,  # [B, K, V] the distributions the draft tokens were sampled from
    n_draft: torch.Tensor | None = None,  # [B] long: real draft tokens per row (None: all K)
    clock: Callable[[str], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Steps 2-3: ``verify_logits`` then ``accept_logits``. Reads ``state`` (writes only the target's
    cache); returns (n_accepted [B], next_token [B]) for ``commit``. ``clock("target")`` after the forward."""
    logits = verify_logits(target, state, sampling, draft_tokens, n_draft)
    if clock is not None:
        clock("target")
    return accept_logits(logits, sampling, rand, draft_tokens, q, n_draft)


@dataclass
class StepLogprobs:
    """Log probabilities of the tokens a step committed, per verified position (position t holds
    the t-th committed token: a draft while t < n_accepted, then the correction or bonus token)."""

    chosen: torch.Tensor  # [B, K+1] float
    top_ids: torch.Tensor  # [B, K+1, N] long, most likely first
    top: torch.Tensor  # [B, K+1, N] float


def step_logprobs(logits: torch.Tensor, draft_tokens: torch.Tensor, n_accepted: torch.Tensor, next_token: torch.Tensor,
                  n: int) -> StepLogprobs:  # fmt: skip
    """Logprobs of the processed logits [B, K+1, V] (before temperature) at the committed tokens,
    with the ``n`` most likely alternatives."""
    B, k = draft_tokens.shape
    lp = torch.log_softmax(logits, -1)  # [B, K+1, V]
    new = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], 1).scatter(1, n_accepted.unsqueeze(1), next_token.unsqueeze(1))
    top, ids = lp.topk(n, dim=-1) if n else (lp.new_zeros(B, k + 1, 0), new.new_zeros(B, k + 1, 0))
    return StepLogprobs(lp.gather(2, new.unsqueeze(2)).squeeze(2), ids, top)


def verify_half(
    target: ModelRunner,
    state: DecodeState,
    sampling: SamplingTensors,
    rand: StepRandom,
    draft_tokens: torch.Tensor,  # [B, K] long
    q: torch.Tensor,  # [B, K, V] the distributions the draft tokens were sampled from
    n_draft: torch.Tensor | None = None,  # [B] long: real draft tokens per row (None: all K)
    clock: Callable[[str], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Steps 2-4: ``verify_tokens``, then ``commit``. Mutates ``state``; returns (n_accepted [B],
    next_token [B], n_new [B]): a draft node that holds its own copy of the state commits
    (n_accepted, next_token) to it."""
    n_accepted, next_token = verify_tokens(target, state, sampling, rand, draft_tokens, q, n_draft, clock)
    return n_accepted, next_token, commit(state, draft_tokens, n_accepted, next_token)


def commit(
    state: DecodeState,
    draft_tokens: torch.Tensor,  # [B, K] long
    n_accepted: torch.Tensor,  # [B] long
    next_token: torch.Tensor,  # [B] long: the correction or bonus token
) -> torch.Tensor:
    """Step 4: write the accepted drafts then the new token, stopping at EOS and at the row's
    limit; done rows stay frozen. Mutates ``state``; returns n_new [B]."""
    B, k = draft_tokens.shape
    n = state.lengths  # [B]
    arange_k1 = torch.arange(k + 1, device=n.device)  # [K+1]
    new = torch.cat([draft_tokens, draft_tokens.new_zeros(B, 1)], dim=1)  # [B, K+1]
    new = new.scatter(1, n_accepted.unsqueeze(1), next_token.unsqueeze(1))
    proposed = n_accepted + 1  # [B]
    is_eos = torch.isin(new, state.eos_ids) & (arange_k1 < proposed.unsqueeze(1))  # [B, K+1]
    first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1), k + 1)  # [B]
    n_new = torch.minimum(torch.minimum(proposed, first_eos + 1), state.limits - n)
    n_new = torch.where(state.done, 0, n_new)  # [B]
    write = arange_k1 < n_new.unsqueeze(1)  # [B, K+1]
    slots = n.unsqueeze(1) + arange_k1  # [B, K+1]
    old = state.tokens.gather(1, slots)
    state.tokens.scatter_(1, slots, torch.where(write, new, old))
    state.done |= (first_eos < n_new) | (n + n_new >= state.limits)
    state.lengths += n_new
    return n_new


# ---- admission -----------------------------------------------------------------------------------


def prefill_first_token(
    target: ModelRunner, prompt: torch.Tensor, slot: int, params: SamplingParams, u: torch.Tensor
) -> int:
    """Prefill ``prompt`` ([1, L] long) into the target's cache row ``slot`` and draw the first new
    token with uniform ``u`` ([1]) under ``params``."""
    return first_token(target.prefill(prompt, slot), params, u, prompt[0].tolist())[0]


def first_token(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor, prompt: list[int] | None = None,
                tokenizer=None) -> tuple[int, StepLogprobs | None]:  # fmt: skip
    """The first new token from the logits after the prompt ([1, 1, V]), drawn with uniform ``u``
    ([1]) under ``params`` (its processors see the ``prompt``; a grammar needs the ``tokenizer``),
    and its logprobs if it asks."""
    rows = first_rows(params, prompt or [], logits.shape[-1], logits.device, tokenizer)
    logits = logits.float() if rows is None else process(logits.float(), rows)
    probs = probs_from_logits(logits, SamplingTensors.build([params], logits.device))
    token = sample(probs[:, 0], u.to(logits.device))  # [1]
    lp = None
    if params.logprobs is not None:
        empty = token.new_zeros(1, 0)
        lp = step_logprobs(logits, empty, empty.new_zeros(1), token, params.logprobs)
    return int(token), lp


def start_row(state: DecodeState, slot: int, prompt: torch.Tensor, first: int, max_new_tokens: int) -> bool:
    """Put a request into row ``slot``: prompt ([L] long) plus its first token committed, the limit
    at L + max_new_tokens. Returns whether the row is already done (EOS or a one-token limit)."""
    L = prompt.shape[0]
    state.tokens[slot, :L] = prompt
    state.tokens[slot, L] = first
    state.lengths[slot] = L + 1
    state.limits[slot] = L + max_new_tokens
    done = max_new_tokens == 1 or bool((state.eos_ids == first).any())
    state.done[slot] = done
    return done


def step_uniforms(generators: list[torch.Generator | None], k_rows: list[int], k: int, device) -> StepRandom:
    """The uniforms of one step, [B, K] padded. Row b takes 2 * k_rows[b] + 1 draws from its own
    generator, in a fixed order: its draft tokens, its accept tests, then the correction or bonus
    draw. What a row consumes depends only on its own K, never on the step's K or on the other
    rows, so a seeded request's output does not depend on what else is in the batch. The accept
    tests must be draws of their own: reusing the ones that drew the draft tokens would correlate
    each test with its token and bias sampled output. Empty slots (None) get zeros."""
    B = len(generators)
    draft, accept, nxt = torch.zeros(B, k), torch.zeros(B, k), torch.zeros(B)  # [B, K], [B, K], [B]
    for b, (g, kb) in enumerate(zip(generators, k_rows)):
        if g is None:
            continue
        u = torch.rand(2 * kb + 1, generator=g)
        draft[b, :kb], accept[b, :kb], nxt[b] = u[:kb], u[kb : 2 * kb], u[2 * kb]
    return StepRandom(draft=draft.to(device), accept=accept.to(device), next=nxt.to(device))
