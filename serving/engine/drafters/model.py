"""The model drafter: a small causal LM on the target's tokenizer, drafting on the device.

The draft model runs in a ``ModelRunner`` with its own static KV cache. A row of that cache is
taken when a request starts (its prompt prefilled there) and freed when it stops, so the cache
row ``r`` serves engine slot ``owner[r]``. Each step the drafter drafts for its own rows only:
it gathers them from the engine's rows, runs ``draft_half`` at the smallest batch bucket holding
its highest cache row, and scatters the proposals back. Three model drafters with two requests
each cost three 2-row drafts, not three full-batch ones. Two drafter names for one model share
one ``ModelDrafter`` (one cache): a row drafts with one name only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serving.engine.drafters.base import BatchDrafter, DraftBatch, Proposal, RowContext
from serving.engine.runner import ModelRunner
from serving.engine.speculative import draft_half


class ModelDrafter(BatchDrafter):
    kind = "model"

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.runner: ModelRunner | None = None  # built by bind, for the engine's batch
        self.owner: list[int | None] = []  # cache row -> the engine slot it drafts for

    def bind(self, *, batch_size: int, max_len: int, vocab_size: int) -> None:
        self.runner = ModelRunner(self.model, batch_size=batch_size, max_len=max_len, vocab_size=vocab_size)
        self.owner = [None] * batch_size

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def start(self, row: int, ctx: RowContext) -> None:
        r = self.owner.index(None)  # the lowest free cache row: keeps the draft's bucket small
        self.owner[r] = row
        ids = torch.tensor([list(ctx.prompt)], dtype=torch.long, device=self.runner.device)  # [1, L]
        self.runner.prefill(ids, r)

    def stop(self, row: int, finished: bool) -> None:
        if row in self.owner:
            self.owner[self.owner.index(row)] = None

    def propose_rows(self, batch: DraftBatch) -> Proposal | None:
        budgets = batch.budgets
        # The cache rows drafting this step, and the engine slot each drafts for.
        owner = [b if b is not None and budgets[b] > 0 else None for b in self.owner]
        own = [r for r, b in enumerate(owner) if b is not None]
        if not own:
            return None
        B, device = len(budgets), batch.state.lengths.device
        n_rows = next(n for n in batch.batch_buckets if n > own[-1])
        fill = owner[own[0]]  # rows of the bucket without a request read any real row, draft nothing
        index = torch.tensor([b if b is not None else fill for b in owner[:n_rows]], device=device)  # [n]
        budget = torch.tensor([budgets[b] if b is not None else 0 for b in owner[:n_rows]], device=device)  # [n]
        state = batch.state.rows(index)
        state.done |= budget == 0  # rows of the bucket without a budget draft nothing
        tokens, q, n = draft_half(self.runner, state, batch.sampling.rows(index), batch.rand.rows(index),
                                  max(budgets[owner[r]] for r in own), batch.vocab_size, batch.draft_confidence,
                                  batch.draft_stop, budget)  # fmt: skip
        forwards = tokens.shape[1]
        # Back to the engine's rows: [n, K] -> [B, K] (rows not this drafter's stay zero, n 0).
        at = torch.tensor([owner[r] for r in own], device=device)  # [m] engine slots
        mine = torch.tensor(own, device=device)  # [m] this drafter's cache rows
        tokens = tokens.new_zeros(B, tokens.shape[1]).index_copy_(0, at, tokens[mine])  # [B, K]
        q = q.new_zeros(B, *q.shape[1:]).index_copy_(0, at, q[mine])  # [B, K, V]
        n = n.new_zeros(B).index_copy_(0, at, n[mine])  # [B]
        confidence = q.gather(2, tokens.unsqueeze(2)).squeeze(2)  # [B, K] q of each proposed token
        return Proposal(tokens, q, n, confidence=confidence, forwards=forwards)

    def compile(self, backend: str, shapes: int) -> None:
        self.runner.compile(backend, shapes=shapes)

    def use_cuda_graphs(self) -> None:
        self.runner.use_cuda_graphs()

    def warmup(self, rows: int, widths: Sequence[int] = (1, 2)) -> None:
        self.runner.warmup(tuple(widths), last_only=True, rows=rows)  # draft_half's forward shapes

    @property
    def forward_shapes(self) -> int:
        return 2  # draft_half's two widths: 2 tokens on its first call, 1 after
