"""Logits processors, exact under speculation: ``logit_bias``, repetition, frequency and presence
penalties, applied to the target's logits at every position a step verifies.

A request's processed distribution at position t is p'_t = process(target logits at t, the tokens
before t), and under speculation the tokens before t include the draft tokens before t. One
verify forward gives the logits of K + 1 positions, so each position is processed with the
history it would have if the drafts before it were committed: the row's committed counts plus the
drafts before t. The acceptance rule then compares p' with q, the distribution the drafts were
drawn from, and draws the residual or bonus token from p' too, so the output is distributed
exactly as decoding the processed target alone (greedy: the same tokens).

Two phases per step, like any processor with per-row state (a grammar later holds a matcher the
same way): ``process`` reads the row's committed state and the step's drafts (provisional: nothing
changes); ``commit`` adds the tokens the step committed. A rejected draft therefore never enters
the state, and a step that fails and is run again finds it as it was.

The order is vLLM's: logit_bias, then the penalties (repetition, frequency, presence); then
``serving.engine.sampling`` applies temperature, min_p, top-k and top-p. Logprobs are read after
the penalties, before temperature (vLLM's processed logprobs).

    repetition (vLLM, transformers): a token in the prompt or the output: logit / r if positive, else logit * r
    frequency, presence (OpenAI, output tokens only): logit - f * count - p * (count > 0)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from serving.engine.grammar import apply_masks, grammars_for
from serving.engine.sampling import SamplingParams


@dataclass
class ProcessorRows:
    """The processor state of a batch's rows, on the device (views of the engine's rows, so a commit
    lands in place). Host flags say what any row uses, so a batch without penalties skips them."""

    counts: torch.Tensor  # [B, V] float: each token's count among the row's generated tokens
    seen: torch.Tensor  # [B, V] bool: tokens in the row's prompt or output
    bias: torch.Tensor  # [B, V] float: the row's logit_bias
    repetition: torch.Tensor  # [B] float, 1 = off
    frequency: torch.Tensor  # [B] float, 0 = off
    presence: torch.Tensor  # [B] float, 0 = off
    biased: bool = True
    penalized: bool = True
    # Grammar rows: (row, its matcher) and the grammars they come from (serving.engine.grammar).
    grammar: list[tuple[int, Any]] = field(default_factory=list)
    grammars: Any = None

    @classmethod
    def empty(cls, rows: int, vocab_size: int, device, **flags) -> "ProcessorRows":
        """``rows`` rows that process nothing yet (no counts, no bias, every penalty off)."""
        zeros = lambda *shape, **kw: torch.zeros(*shape, device=device, **kw)  # noqa: E731
        return cls(zeros(rows, vocab_size), zeros(rows, vocab_size, dtype=torch.bool), zeros(rows, vocab_size),
                   torch.ones(rows, device=device), zeros(rows), zeros(rows), **flags)  # fmt: skip


def penalties(logits: torch.Tensor, counts: torch.Tensor, seen: torch.Tensor, repetition: torch.Tensor,
              frequency: torch.Tensor, presence: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """The penalties on ``logits`` [..., V'] given each entry's ``counts`` and ``seen`` (same shape)
    and the rows' settings broadcast against them ([..., 1])."""
    rep = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, rep, logits)
    return logits - frequency * counts - presence * (counts > 0).to(logits.dtype)


def process(logits: torch.Tensor, rows: ProcessorRows, drafts: torch.Tensor | None = None,
            n_draft: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
    """The processed logits [B, T, V] at T verified positions (``logits`` [B, T, V] fp32, left as
    it is): position t sees the row's committed tokens and ``drafts[:, :t]`` ([B, T-1] long; only
    the first ``n_draft`` [B] of a row are real, the rest padding that no position sees).

    Sparse where the processors are: a bias moves the tokens some row biases, a penalty the tokens
    some row has seen (or drafts), so only those columns are touched (a few thousand of 150K)."""
    B, T, V = logits.shape
    out = logits.clone()  # the forward's own output buffer stays as it was
    if rows.biased:
        ids = rows.bias.ne(0).any(0).nonzero().flatten()  # [U] tokens any row biases
        out[:, :, ids] += rows.bias[:, ids].unsqueeze(1)
    if rows.penalized:
        _penalize(out, rows, drafts, n_draft)
    if rows.grammar:  # each grammar row's mask at each position, its matcher along the drafts before it
        real = [int(n) for n in n_draft.tolist()] if n_draft is not None else [T - 1] * B
        listed = drafts.tolist() if drafts is not None else [[] for _ in range(B)]
        masks = rows.grammars.masks([(b, m, listed[b][: real[b]]) for b, m in rows.grammar], B, T)
        out = apply_masks(out, masks)
    return out


def _penalize(out: torch.Tensor, rows: ProcessorRows, drafts: torch.Tensor | None, n_draft: torch.Tensor | None) -> None:
    """The penalties, in place on ``out`` [B, T, V]: every seen token at its committed count, then
    each draft token's own id at each position with the drafts before it counted."""
    B, T, V = out.shape
    r, f, p = (x.view(B, 1, 1) for x in (rows.repetition, rows.frequency, rows.presence))
    K = 0 if drafts is None or T == 1 else drafts.shape[1]
    if K:
        ids = drafts.unsqueeze(1).expand(B, T, K)  # [B, T, K]
        before_penalty = out.gather(2, ids)  # [B, T, K] the draft ids' logits, biased, not yet penalised
    seen_ids = rows.seen.any(0).nonzero().flatten()  # [U] tokens any row has seen: the only ones a count moves
    out[:, :, seen_ids] = penalties(out[:, :, seen_ids], rows.counts[:, seen_ids].unsqueeze(1),
                                    rows.seen[:, seen_ids].unsqueeze(1), r, f, p)  # fmt: skip
    if not K:
        return
    real = torch.ones_like(drafts, dtype=torch.bool) if n_draft is None else (
        torch.arange(K, device=drafts.device) < n_draft.unsqueeze(1))  # [B, K]  # fmt: skip
    same = ((drafts.unsqueeze(2) == drafts.unsqueeze(1)) & real.unsqueeze(2)).float()  # [B, K(i), K(j)] real d_i == d_j
    before = (torch.arange(K, device=drafts.device) < torch.arange(T, device=drafts.device).unsqueeze(1)).float()  # [T, K(i)]
    extra = torch.einsum("ti,bij->btj", before, same)  # [B, T, K] real drafts before t equal to d_j
    counts = rows.counts.gather(1, drafts).unsqueeze(1) + extra  # [B, T, K]
    seen = rows.seen.gather(1, drafts).unsqueeze(1) | (extra > 0)  # [B, T, K]
    out.scatter_(2, ids, penalties(before_penalty, counts, seen, r, f, p))


class Processors:
    """The engine's processor state: a row per slot, allocated the first time a request uses a
    processor (then kept: static shapes). ``start`` sets a row for its request, ``commit`` adds
    a step's committed tokens, ``rows`` hands the verifier a batch's rows."""

    def __init__(self, batch_size: int, vocab_size: int, device: torch.device, tokenizer: Any = None) -> None:
        self.B, self.V, self.device, self.tokenizer = batch_size, vocab_size, device, tokenizer
        self.state: ProcessorRows | None = None
        self.active: list[bool] = [False] * batch_size  # rows whose request uses a processor
        self.matchers: dict[int, Any] = {}  # grammar rows: row -> its matcher after its committed tokens

    def start(self, row: int, params: SamplingParams, prompt: Sequence[int], first: int) -> None:
        """The row's request was admitted with ``prompt`` and its first token ``first``."""
        self.active[row] = bool(params.processors)
        self.matchers.pop(row, None)
        if params.grammar is not None:
            matcher = grammars_for(self.tokenizer, self.V).matcher(params.grammar)
            matcher.consume_token(first)  # drawn under the grammar's mask (the prefill's first_token)
            self.matchers[row] = matcher
        if self.state is None and self.active[row]:
            self.state = ProcessorRows.empty(self.B, self.V, self.device)
        if self.state is not None:  # a row without processors is reset too: its neighbours' batches read it
            fill_row(self.state, row, params, prompt, [first])

    def stop(self, row: int) -> None:
        self.active[row] = False
        self.matchers.pop(row, None)

    def forced(self, rows: int) -> dict[int, list[int]]:
        """Grammar rows among the first ``rows`` whose grammar forces their next tokens: row -> the
        forced text's canonical tokens (llguidance's fast-forward tokens), proposed as free drafts."""
        out = {}
        for b, m in self.matchers.items():
            tokens = m.compute_ff_tokens() if b < rows else []
            tokens = tokens[: next((i for i, t in enumerate(tokens) if t >= self.V), len(tokens))]  # the logits' ids only
            if tokens:
                out[b] = tokens
        return out

    def observe(self, row: int, tokens: Sequence[int]) -> None:
        """The step committed ``tokens`` to ``row`` (host side, after the step's sync): a grammar
        row's matcher follows them."""
        matcher = self.matchers.get(row)
        if matcher is not None and tokens:
            matcher.consume_tokens(list(tokens))

    def rows(self, n: int, params: Sequence[SamplingParams | None]) -> ProcessorRows | None:
        """The first ``n`` rows (a step's batch bucket), or None when none of them uses a processor."""
        if self.state is None or not any(self.active[:n]):
            return None
        s = self.state
        return ProcessorRows(s.counts[:n], s.seen[:n], s.bias[:n], s.repetition[:n], s.frequency[:n], s.presence[:n],
                             biased=any(p is not None and bool(p.logit_bias) for p in params),
                             penalized=any(p is not None and p.penalized for p in params),
                             grammar=[(b, m) for b, m in sorted(self.matchers.items()) if b < n],
                             grammars=grammars_for(self.tokenizer, self.V) if self.matchers else None)  # fmt: skip

    def commit(self, tokens: torch.Tensor, n_new: torch.Tensor) -> None:
        """A step committed ``tokens[b, :n_new[b]]`` ([n, T] long, [n] long) to each of the first n rows."""
        if self.state is None or not any(self.active[: tokens.shape[0]]):
            return
        n = tokens.shape[0]
        kept = (torch.arange(tokens.shape[1], device=tokens.device) < n_new.unsqueeze(1)).float()  # [n, T]
        self.state.counts[:n].scatter_add_(1, tokens, kept)
        self.state.seen[:n] |= self.state.counts[:n] > 0


def fill_row(state: ProcessorRows, row: int, params: SamplingParams, prompt: Sequence[int], generated: Sequence[int]) -> None:
    """Set ``row`` of ``state`` for a request: its settings, its prompt seen, ``generated`` counted."""
    dev = state.counts.device
    state.counts[row].zero_()
    state.seen[row].zero_()
    state.bias[row].zero_()
    if params.repetition_penalty != 1.0:
        state.seen[row, torch.tensor(list(prompt), dtype=torch.long, device=dev)] = True
    if generated:
        state.counts[row].index_add_(0, torch.tensor(list(generated), dtype=torch.long, device=dev),
                                     torch.ones(len(generated), device=dev))  # fmt: skip
        state.seen[row] |= state.counts[row] > 0
    V = state.bias.shape[1]
    for token, bias in params.logit_bias:
        if token < V:  # ids past the logits are refused at the API; a wider tokenizer's extra ids have no logit
            state.bias[row, token] += bias
    state.repetition[row], state.frequency[row], state.presence[row] = (
        params.repetition_penalty, params.frequency_penalty, params.presence_penalty)


def first_rows(params: SamplingParams, prompt: Sequence[int], vocab_size: int, device, tokenizer: Any = None) -> ProcessorRows | None:
    """One row's state before its first token (for the prefill's draw), or None without processors."""
    if not params.processors:
        return None
    grammars = grammars_for(tokenizer, vocab_size) if params.grammar is not None else None
    state = ProcessorRows.empty(1, vocab_size, device, biased=bool(params.logit_bias), penalized=params.penalized,
                                grammar=[(0, grammars.matcher(params.grammar))] if grammars else [], grammars=grammars)  # fmt: skip
    fill_row(state, 0, params, prompt, [])
    return state
