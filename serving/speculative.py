"""One speculative decoding step for a static batch: draft K, verify once, accept/reject, commit.

Per row, with n committed tokens x_0..x_{n-1}: the target's cache holds positions 0..n-2 and the
draft's at least 0..n-3; x_{n-1} is the input of this step. Rows accept different numbers of
tokens, finish on their own, and keep running (frozen) once done, so no shape ever changes.
K = 0 (or no draft) is the target-only decoder: the same step, one token per target call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from serving.acceptance import accept_reject
from serving.runner import ModelRunner
from serving.sampling import SamplingTensors, probs_from_logits, sample


@dataclass
class DecodeState:
    """Device-side state of a batch of B slots; every tensor keeps its shape for the whole run."""

    tokens: torch.Tensor  # [B, S + K_max + 1] long: committed tokens; past each length, stale
    lengths: torch.Tensor  # [B] long: committed tokens n (prompt + generated)
    limits: torch.Tensor  # [B] long: length at which a row stops (prompt + max new tokens)
    done: torch.Tensor  # [B] bool: finished rows stay in the batch, frozen
    eos_ids: torch.Tensor  # [E] long


@dataclass
class StepRandom:
    """Uniforms for one step, drawn on the host from each request's own generator."""

    draft: torch.Tensor  # [B, K] draws for the draft tokens
    accept: torch.Tensor  # [B, K] accept tests
    next: torch.Tensor  # [B] residual or bonus draw


def speculative_step(
    target: ModelRunner,
    draft: ModelRunner | None,
    state: DecodeState,
    sampling: SamplingTensors,
    rand: StepRandom,
    k: int,
    clock: Callable[[str], None] | None = None,
    draft_confidence: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Advance every row by one target call. Mutates ``state`` (tokens, lengths, done) in place and
    returns (n_accepted [B], n_new [B], k): draft tokens accepted, tokens committed this step
    (accepted + 1 correction or bonus token, cut at EOS and at the row's limit, 0 if done), and
    how many tokens were drafted (k, or fewer after a ``draft_confidence`` stop).

    ``clock(phase)``, if given, is called after the draft and after the verification, for timing;
    leave it None to compile the whole step into one graph.

    ``draft_confidence``: stop drafting early once every row's draft is less sure than this (its
    top probability), as transformers' assisted generation does; the verification then covers the
    shorter block. It reads a flag back after each draft token, so it is meant for CPUs, where that
    costs nothing; leave it None for one host sync per step and a single compiled graph.
    """
    B = state.lengths.shape[0]
    n = state.lengths  # [B]
    arange_k1 = torch.arange(k + 1, device=n.device)  # [K+1]
    current = state.tokens.gather(1, (n - 1).unsqueeze(1))  # [B, 1] x_{n-1}

    # 1. Draft K tokens autoregressively. The first call re-feeds x_{n-2} too: after a step in which
    #    all K were accepted the draft never saw its own last token, and always feeding two keeps
    #    the shape fixed instead of branching on the host.
    drafted, q = [], []
    if k > 0 and draft is not None:
        pos = torch.stack([n - 2, n - 1], dim=1)  # [B, 2]
        logits = draft.forward(state.tokens.gather(1, pos), pos, last_only=True)  # [B, 1, V]
        for i in range(k):
            if i > 0:
                logits = draft.forward(drafted[-1].unsqueeze(1), (n - 1 + i).unsqueeze(1))  # [B, 1, V]
            q_i = probs_from_logits(logits, sampling)[:, 0]  # [B, V]
            drafted.append(sample(q_i, rand.draft[:, i]))  # [B]
            q.append(q_i)
            if draft_confidence is not None and i + 1 < k:
                unsure = torch.softmax(logits[:, 0].float(), -1).amax(-1) < draft_confidence  # [B]
                if bool((unsure | state.done).all()):
                    k = i + 1
                    arange_k1 = arange_k1[: k + 1]
                    break
    else:
        k = 0
        arange_k1 = arange_k1[:1]
    V = target.vocab_size
    draft_tokens = torch.stack(drafted, 1) if drafted else n.new_zeros(B, 0)  # [B, K]
    q_all = torch.stack(q, 1) if q else torch.zeros(B, 0, V, device=n.device)  # [B, K, V]
    if clock is not None:
        clock("draft")

    # 2. Verify all K draft tokens and get the bonus distribution in one target forward.
    verify_in = torch.cat([current, draft_tokens], dim=1)  # [B, K+1]
    verify_pos = (n - 1).unsqueeze(1) + arange_k1  # [B, K+1]
    p = probs_from_logits(target.forward(verify_in, verify_pos), sampling)  # [B, K+1, V]
    if clock is not None:
        clock("target")

    # 3. Accept/reject (Leviathan et al. 2023); the residual or bonus token comes with it.
    n_accepted, next_token = accept_reject(p, q_all, draft_tokens, rand.accept[:, :k], rand.next)

    # 4. Commit: accepted drafts then the new token, stopping at EOS and at the row's limit.
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
    return n_accepted, n_new, k
