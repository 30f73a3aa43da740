"""Speculative sampling's accept/reject rule as a pure function of probabilities and tokens.

Leviathan, Kalman and Matias, "Fast Inference from Transformers via Speculative Decoding",
ICML 2023 (arXiv 2211.17192), Algorithm 1. Notation, fixed here for the whole package:

    p = the target's distribution, q = the draft's distribution (after the same sampling
    transform), x_1..x_K = the draft's tokens, x_i ~ q_i.

Token x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)), in order, until the first
rejection. At the first rejected position j the next token is drawn from the residual
norm(max(0, p_j - q_j)); when all K are accepted a bonus token is drawn from p_{K+1}. The output
then follows p exactly (Theorem 1 of the paper). With greedy decoding p and q are one-hot, so the
rule becomes "accept while x_i == argmax p_i", and the residual is the target's argmax.

Opt-in and lossy, per row: threshold verification (``threshold_accepts``) also accepts a draft
token whose target probability at temperature 1 is at least the row's threshold, as Medusa's
typical acceptance and vLLM's old typical-acceptance sampler do. Such a row's output is no longer
the target's; rows without a threshold (``lossy_accept`` False for them) are untouched.

Everything is batched and shape-static: each row accepts its own number of tokens, but no tensor
shape depends on it, so the function compiles into one graph.
"""

from __future__ import annotations

import torch

from serving.engine.sampling import sample


def accept_reject(
    p: torch.Tensor,  # [B, K+1, V] target probabilities at the K draft positions and the bonus one
    q: torch.Tensor,  # [B, K, V] draft probabilities the draft tokens were sampled from
    draft_tokens: torch.Tensor,  # [B, K] long
    u_accept: torch.Tensor,  # [B, K] uniforms for the accept tests
    u_next: torch.Tensor,  # [B] uniform for the residual or bonus draw
    n_draft: torch.Tensor | None = None,  # [B] long: real draft tokens per row, the rest padding
    lossy_accept: torch.Tensor | None = None,  # [B, K] bool: drafts threshold verification accepts too
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (n_accepted [B] long in 0..K, next_token [B] long).

    The committed tokens of the step are draft_tokens[:, :n_accepted] followed by next_token.
    K = 0 is the target-only step: nothing to accept, next_token is drawn from p_1.
    ``n_draft``: a row that drafted fewer than K tokens (its own K, or an early stop) has padding
    slots after them. They propose nothing (q = 0 there), so they are never accepted and the
    token after the row's last draft is its bonus, drawn from p: the row's output is what it
    would be in a batch whose K were its own.
    ``lossy_accept`` (``threshold_accepts``): drafts accepted whatever the test says; the first
    draft neither accepts is replaced by the residual draw, as the exact rule replaces it. None
    (every exact batch) leaves the rule exactly Leviathan et al.'s.
    """
    B, K1, V = p.shape
    K = K1 - 1
    p_x = p[:, :K].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, K]
    if n_draft is not None:
        real = torch.arange(K, device=p.device) < n_draft.unsqueeze(1)  # [B, K]
        q = q * real.unsqueeze(-1)  # [B, K, V]
    q_x = q.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, K]
    # u < p/q, written without a division (q_x > 0 for sampled tokens, but keep it branch-free).
    # A padding slot has q_x = 0, so u * 0 < p_x could pass: it is masked out explicitly.
    accepted = u_accept * q_x < p_x  # [B, K]
    if lossy_accept is not None:
        accepted |= lossy_accept
    if n_draft is not None:
        accepted &= real
    n_accepted = accepted.long().cumprod(-1).sum(-1)  # [B] accepted before the first rejection

    # A zero "draft distribution" after the last position turns the bonus into a residual draw.
    q_pad = torch.cat([q, q.new_zeros(B, 1, V)], dim=1)  # [B, K+1, V]
    at = n_accepted.view(B, 1, 1).expand(B, 1, V)
    p_at = p.gather(1, at).squeeze(1)  # [B, V]
    residual = (p_at - q_pad.gather(1, at).squeeze(1)).clamp(min=0.0)  # [B, V]
    # p <= q everywhere only happens through rounding (it would mean p == q); fall back to p.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    return n_accepted, sample(residual, u_next)


def threshold_accepts(
    p_plain: torch.Tensor,  # [B, K, V] target probabilities at temperature 1, no top-k/top-p
    draft_tokens: torch.Tensor,  # [B, K] long
    threshold: torch.Tensor,  # [B] float: a row's verification_threshold, 0 for an exact row
) -> torch.Tensor:
    """[B, K] bool: the drafts threshold verification accepts besides the exact rule's: p(x) at
    temperature 1 is at least the row's threshold. Taken before the request's own transforms
    because at temperature 0 the transformed p is one-hot and the rule would be the exact one.
    An exact row (threshold 0) accepts nothing here, whatever its probabilities."""
    p_x = p_plain.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, K]
    lossy = (threshold > 0).unsqueeze(1)  # [B, 1]
    return lossy & (p_x >= threshold.unsqueeze(1))
