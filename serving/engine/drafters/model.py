"""The model drafter: a small causal LM on the target's tokenizer, drafting on the device.

The draft model runs in a ``ModelRunner`` with its own static KV cache. A row of that cache is
taken when a request starts (its prompt prefilled there) and freed when it stops, so the cache
row ``r`` serves engine slot ``owner[r]``. Each step the drafter drafts for its own rows only:
it gathers them from the engine's rows, runs ``draft_half`` at the smallest batch bucket holding
its highest cache row, and scatters the proposals back. Three model drafters with two requests
each cost three 2-row drafts, not three full-batch ones. Two drafter names for one model share
one ``ModelDrafter`` (one cache): a row drafts with one name only.

A row's prompt is read into its cache row the first time the row drafts, not when it starts (the
same prefill call over the same prompt, later): under load a goodput cap may never let a row draft,
and a request ``auto`` serves with the copy drafters alone never needs it, so neither pays a draft
prefill it will not use. A row need not draft every step (``auto`` drafts some steps with a copy
drafter, a goodput cap may skip a step). Each cache row keeps ``seen``, how many leading positions its cache holds for
the row's committed tokens, and ``length``, the row's committed tokens (both on the host, from
``start`` and ``observe``: no device read). ``draft_half`` needs positions 0..n-3 in the cache
(it feeds x_{n-2} and x_{n-1} itself), so a row behind by g tokens first reads them, the
catch-up: forwards of that row alone (as its prefill, so what it holds never depends on the
batch) over CATCH_UP widths (the largest that fits the gap, else the smallest that holds it).
Positions past the gap are written with whatever the decode state holds there and rewritten
before any query reads them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serving.engine.drafters.base import BatchDrafter, DraftBatch, Drafter, Proposal, RowContext
from serving.engine.runner import ModelRunner
from serving.engine.speculative import draft_half

CATCH_UP = (4, 16, 64)  # compiled catch-up widths (a row's gap is read in chunks of these)


def catch_up_chunks(gap: int, widths: Sequence[int] = CATCH_UP) -> list[int]:
    """The forward widths that read a gap of ``gap`` tokens: the largest width that fits the rest,
    else the smallest that holds it (its tail reads past the gap, harmlessly)."""
    chunks, rest = [], gap
    while rest > 0:
        fits = [w for w in widths if w <= rest]
        w = fits[-1] if fits else min(widths)
        chunks.append(w)
        rest -= w
    return chunks


class ModelDrafter(BatchDrafter):
    kind = "model"

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.runner: ModelRunner | None = None  # built by bind, for the engine's batch
        self.owner: list[int | None] = []  # cache row -> the engine slot it drafts for
        self.seen: list[int] = []  # cache row -> leading positions its cache holds for the row's tokens
        self.length: list[int] = []  # cache row -> the row's committed tokens (prompt + generated)
        self.deferred: list[torch.Tensor | None] = []  # cache row -> its prompt [1, L], until the row first drafts
        self._fed: dict[int, tuple[int, int]] = {}  # cache row -> (n, forwards) of the step it drafted

    def bind(self, *, batch_size: int, max_len: int, vocab_size: int) -> None:
        self.runner = ModelRunner(self.model, batch_size=batch_size, max_len=max_len, vocab_size=vocab_size)
        self.owner = [None] * batch_size
        self.seen, self.length = [0] * batch_size, [0] * batch_size
        self.deferred = [None] * batch_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def start(self, row: int, ctx: RowContext) -> None:
        r = self.owner.index(None)  # the lowest free cache row: keeps the draft's bucket small
        self.owner[r] = row
        # Counted as read (the prices of catching up, auto's and goodput's, are what they were with an
        # eager prefill); read on the row's first draft (``_catch_up``).
        self.deferred[r] = torch.tensor([list(ctx.prompt)], dtype=torch.long, device=self.runner.device)  # [1, L]
        self.seen[r] = self.length[r] = len(ctx.prompt)
        self._fed.pop(r, None)

    def observe(self, row: int, new_tokens: Sequence[int], hidden=None) -> None:
        """The row committed ``new_tokens``. After a step it drafted (k forwards from length n),
        its cache holds the accepted drafts too: n + min(accepted, k - 1) positions."""
        if row not in self.owner:
            return
        r = self.owner.index(row)
        fed = self._fed.pop(r, None)
        if fed is not None:
            n, forwards = fed
            self.seen[r] = max(self.seen[r], n + min(len(new_tokens) - 1, forwards - 1))
        self.length[r] += len(new_tokens)

    def stop(self, row: int, finished: bool) -> None:
        if row in self.owner:
            r = self.owner.index(row)
            self.owner[r] = None
            self.deferred[r] = None
            self._fed.pop(r, None)

    def gap(self, row: int) -> int:
        """Tokens the row's cache must read before it can draft (0: in step)."""
        r = self.owner.index(row)
        return max(self.length[r] - 2 - self.seen[r], 0)

    def propose_rows(self, batch: DraftBatch) -> Proposal | None:
        budgets = batch.budgets
        self._fed.clear()  # a proposal never observed (its step failed) is replaced by this one
        # The cache rows drafting this step, and the engine slot each drafts for.
        owner = [b if b is not None and budgets[b] > 0 else None for b in self.owner]
        own = [r for r, b in enumerate(owner) if b is not None]
        if not own:
            return None
        B, device = len(budgets), batch.state.lengths.device
        n_rows = next(n for n in batch.batch_buckets if n > own[-1])
        # A row of the bucket drafts nothing unless it has a budget. One with a request reads its own
        # row (its forward then writes past what its cache holds, never into it); a free one reads
        # any real row.
        fill = owner[own[0]]
        index = torch.tensor([b if b is not None else fill for b in (self.owner[r] for r in range(n_rows))], device=device)  # [n]
        budget = torch.tensor([budgets[b] if b is not None else 0 for b in owner[:n_rows]], device=device)  # [n]
        state = batch.state.rows(index)
        self._catch_up(own, state.tokens)
        state.done |= budget == 0  # rows of the bucket without a budget draft nothing
        tokens, q, n = draft_half(self.runner, state, batch.sampling.rows(index), batch.rand.rows(index),
                                  max(budgets[owner[r]] for r in own), batch.vocab_size, batch.draft_confidence,
                                  batch.draft_stop, budget)  # fmt: skip
        forwards = tokens.shape[1]
        for r in own:
            self._fed[r] = (self.length[r], forwards)
        # Back to the engine's rows: [n, K] -> [B, K] (rows not this drafter's stay zero, n 0).
        at = torch.tensor([owner[r] for r in own], device=device)  # [m] engine slots
        mine = torch.tensor(own, device=device)  # [m] this drafter's cache rows
        tokens = tokens.new_zeros(B, tokens.shape[1]).index_copy_(0, at, tokens[mine])  # [B, K]
        q = q.new_zeros(B, *q.shape[1:]).index_copy_(0, at, q[mine])  # [B, K, V]
        n = n.new_zeros(B).index_copy_(0, at, n[mine])  # [B]
        confidence = q.gather(2, tokens.unsqueeze(2)).squeeze(2)  # [B, K] q of each proposed token
        return Proposal(tokens, q, n, confidence=confidence, forwards=forwards)

    def _catch_up(self, own: list[int], tokens: torch.Tensor) -> None:
        """Bring each drafting cache row's cache to position n - 3 (``tokens``: [n_rows, S] the
        rows' decode-state tokens, in cache-row order). Each row reads its gap alone, as its
        prefill did, in CATCH_UP widths: what it holds never depends on the other rows."""
        for r in own:
            if self.deferred[r] is not None:  # the row's first draft: its prompt first, as start would have
                self.runner.prefill(self.deferred[r], r)
                self.deferred[r] = None
            for width in catch_up_chunks(self.length[r] - 2 - self.seen[r]):
                positions = (self.seen[r] + torch.arange(width, device=tokens.device)).clamp(max=self.runner.max_len - 1)  # [W]
                ids = tokens[r].gather(0, positions.clamp(max=tokens.shape[1] - 1))  # [W] past the gap: rewritten later
                self.runner.extend(ids.unsqueeze(0), positions.unsqueeze(0), r)
                self.seen[r] = min(self.seen[r] + width, self.length[r] - 2)

    def compile(self, backend: str, shapes: int) -> None:
        self.runner.compile(backend, shapes=shapes)

    def use_cuda_graphs(self) -> None:
        self.runner.use_cuda_graphs()

    def warmup(self, rows: int, widths: Sequence[int] = (1, 2)) -> None:
        self.runner.warmup(tuple(widths), last_only=True, rows=rows)  # draft_half's forward shapes

    @property
    def forward_shapes(self) -> int:
        return 2  # draft_half's two widths: 2 tokens on its first call, 1 after (a catch-up runs as a prefill)


def as_drafter(drafter_or_model) -> "Drafter":
    """A drafter as given, or a draft model (a causal LM on the target's tokenizer) as a ``ModelDrafter``."""
    return drafter_or_model if isinstance(drafter_or_model, Drafter) else ModelDrafter(drafter_or_model)
