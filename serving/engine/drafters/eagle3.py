"""The ``eagle3`` drafter: an EAGLE-3 head (``serving.engine.eagle3``) drafting from the target's features.

Per engine row (slot ``b``) the head's cache holds, at positions 0..seen-1, the pairs (f_p,
x_{p+1}) of the row's committed tokens: the target's features at position p with the token that
followed. ``pending`` keeps the features the target handed over (``start``: the prompt's;
``observe``: each step's) whose pairs the head has not read yet; there is always at least one, the
feature of position n - 2 paired with the last committed token x_{n-1}. A step then runs, over
this drafter's rows at the smallest batch bucket holding them:

    1. read the pending pairs: one forward of width W = K_max + 1 (a row behind by more first
       reads the rest alone, in CATCH_UP widths); its output at the last pair gives q_1, and the
       row's cache now holds its committed tokens exactly (seen = n - 1)
    2. chain: K - 1 forwards of width 1, each feeding the head's own state and the token it just
       drew at the next position (n - 1, n, ...), written past ``seen``
    3. q over the target's vocabulary: the head's probabilities under the request's sampling
       settings scattered to its draft vocabulary's target ids (q = 0 elsewhere), the token drawn
       from q with the step's uniforms, as the model drafter does

A rejection needs no rewind: the chain's entries lie at positions >= seen, and the next step's
read of the committed pairs overwrites them before any query can see them (the cache's mask is by
position). A row that did not draft a step (``auto`` chose another drafter) keeps its pending
features and reads them next time it drafts. Reading the pending pairs is provisional (the
drafter protocol's rule): ``seen`` and ``pending`` move in ``observe``, once the step committed;
a step that fails and is run again reads the same pairs into the same positions.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from serving.engine.drafters.base import BatchDrafter, DraftBatch, Proposal, RowContext
from serving.engine.drafters.model import catch_up_chunks
from serving.engine.eagle3 import Eagle3Head
from serving.engine.sampling import probs_from_logits, sample


class Eagle3Drafter(BatchDrafter):
    kind = "eagle3"

    def __init__(self, head: Eagle3Head, k: int | None = None) -> None:
        self.head = head.eval()
        self.k = k
        self.target_layers = tuple(head.config.aux_layers)
        self.cache = None
        self.seen: dict[int, int] = {}  # engine row -> positions its cache holds for committed pairs
        self.length: dict[int, int] = {}  # engine row -> committed tokens
        self.pending: dict[int, list[torch.Tensor]] = {}  # engine row -> features not yet read, [m, n * Ht] pieces
        self._read_to: dict[int, int] = {}  # engine row -> seen once this step's proposal commits (provisional)

    @property
    def device(self) -> torch.device:
        return self.head.embed_tokens.weight.device

    def bind(self, *, batch_size: int, max_len: int, vocab_size: int) -> None:
        if vocab_size < self.head.config.vocab_size and int(self.head.head_ids.max()) >= vocab_size:
            raise ValueError(f"the EAGLE-3 head proposes token id {int(self.head.head_ids.max())}, outside the target's "
                             f"{vocab_size}-token logits: a head of another target")  # fmt: skip
        self.cache = self.head.new_cache(batch_size, max_len)
        self.max_len, self.vocab_size = max_len, vocab_size
        self._ids = self.head.head_ids.to(self.device)  # [Vd] target id of each draft id

    def start(self, row: int, ctx: RowContext) -> None:
        if ctx.hidden is None:
            raise ValueError("the eagle3 drafter needs the target's features (RowContext.hidden): the verifier did not capture them")
        prompt = torch.tensor(list(ctx.prompt), dtype=torch.long, device=self.device)  # [L]
        L = prompt.numel()
        # Pairs (f_p, x_{p+1}) of the prompt, p = 0..L-2, read alone as a prefill in fixed widths.
        self._read(row, prompt[1:], ctx.hidden[: L - 1].to(self.device), 0)
        self.seen[row], self.length[row] = L - 1, L
        self.pending[row] = [ctx.hidden[L - 1 :].to(self.device)]  # f_{L-1}: pairs with the first generated token

    def observe(self, row: int, new_tokens: Sequence[int], hidden: torch.Tensor | None = None) -> None:
        if row not in self.length:
            return
        if row in self._read_to:  # the step this row proposed in committed: its read pairs are the row's
            self.seen[row], self.pending[row] = self._read_to.pop(row), []
        self.length[row] += len(new_tokens)
        if hidden is not None and hidden.shape[0]:
            self.pending[row].append(hidden.to(self.device))

    def stop(self, row: int, finished: bool) -> None:
        for d in (self.seen, self.length, self.pending, self._read_to):
            d.pop(row, None)

    def _read(self, row: int, tokens: torch.Tensor, hidden: torch.Tensor, start: int) -> None:
        """Row ``row`` alone reads pairs (hidden[i], tokens[i]) at positions start + i, in CATCH_UP
        widths (a chunk's tail past the pairs reads padding, written past what the row holds)."""
        done = 0
        for width in catch_up_chunks(tokens.numel()):
            ids = _padded(tokens[done : done + width], width)  # [W]
            feats = _padded(hidden[done : done + width], width)  # [W, n * Ht]
            positions = (start + done + torch.arange(width, device=self.device)).clamp(max=self.max_len - 1)  # [W]
            self.head.step(ids[None], feats[None], positions[None], self.cache.row(row))
            done += width

    def propose_rows(self, batch: DraftBatch) -> Proposal | None:
        budgets = batch.budgets
        self._read_to.clear()  # a proposal never observed (its step failed) is replaced by this one
        own = [b for b in sorted(self.length) if budgets[b] > 0]
        if not own:
            return None
        B, k, W = len(budgets), max(budgets[b] for b in own), max(batch.k_max, max(budgets)) + 1
        n_rows = next(n for n in batch.batch_buckets if n > own[-1])
        dev = self.device
        # 1. The pending pairs of every drafting row: the oldest alone if more than W, then W at once.
        tokens = torch.zeros(n_rows, W, dtype=torch.long, device=dev)  # [n, W]
        feats = torch.zeros(n_rows, W, len(self.target_layers) * self.head.config.target_hidden_size, device=dev)  # [n, W, n*Ht]
        positions = torch.arange(W, device=dev).repeat(n_rows, 1)  # [n, W] (rows not drafting: past what they hold)
        last = torch.zeros(n_rows, dtype=torch.long, device=dev)  # [n] index of each row's last pair
        state_tokens = batch.state.tokens
        for b in range(n_rows):
            if b not in self.length:
                continue
            seen = self.seen[b]
            if b not in own:  # writes past what the row holds, never into it
                positions[b] = (seen + torch.arange(W, device=dev)).clamp(max=self.max_len - 1)
                continue
            pending = torch.cat(self.pending[b])  # [m, n * Ht]
            m = pending.shape[0]
            row_tokens = state_tokens[b, seen + 1 : seen + 1 + m]  # [m] x_{p+1} of each pending p
            if m > W:
                self._read(b, row_tokens[: m - W], pending[: m - W], seen)
                seen, row_tokens, pending = seen + m - W, row_tokens[m - W :], pending[m - W :]
                m = W
            tokens[b, :m], feats[b, :m] = row_tokens, pending
            positions[b] = (seen + torch.arange(W, device=dev)).clamp(max=self.max_len - 1)
            last[b] = m - 1
            self._read_to[b] = seen + m
        logits, state = self.head.step(tokens, feats, positions, self.cache)  # [n, W, Vd], [n, W, H]
        pick = last.view(-1, 1, 1)
        logits = logits.gather(1, pick.expand(-1, 1, logits.shape[-1]))  # [n, 1, Vd]
        state = state.gather(1, pick.expand(-1, 1, state.shape[-1]))  # [n, 1, H]
        # 2-3. The chain: q, a token drawn from it, the head's state and that token one position on.
        index = torch.arange(n_rows, device=dev)
        sampling, rand = batch.sampling.rows(index), batch.rand.rows(index)
        budget = torch.tensor([budgets[b] if b in own else 0 for b in range(n_rows)], device=dev)  # [n]
        at = torch.tensor([max(self.length.get(b, 2) - 2, 0) for b in range(n_rows)], device=dev)  # [n] the last pair's position
        drafted, qs = [], []
        for i in range(k):
            if i > 0:
                pos = (at + i).clamp(max=self.max_len - 1).unsqueeze(1)  # [n, 1]
                logits, state = self.head.step(drafted[-1].unsqueeze(1), state, pos, self.cache)
            q = self._target_probs(logits, sampling)  # [n, V]
            drafted.append(sample(q, rand.draft[:, i]))  # [n]
            qs.append(q)
        n = torch.minimum(budget, torch.full_like(budget, k))  # [n] real draft tokens per row
        # Back to the engine's rows: [n, K] -> [B, K].
        rows = torch.tensor(own, device=dev)
        out_tokens = torch.zeros(B, k, dtype=torch.long, device=dev).index_copy_(0, rows, torch.stack(drafted, 1)[rows])
        q_all = torch.zeros(B, k, self.vocab_size, device=dev).index_copy_(0, rows, torch.stack(qs, 1)[rows])  # [B, K, V]
        n_out = torch.zeros(B, dtype=torch.long, device=dev).index_copy_(0, rows, n[rows])
        confidence = q_all.gather(2, out_tokens.unsqueeze(2)).squeeze(2)  # [B, K]
        return Proposal(out_tokens, q_all, n_out, confidence=confidence, forwards=k)

    def _target_probs(self, logits: torch.Tensor, sampling) -> torch.Tensor:
        """logits [n, 1, Vd] over the draft vocabulary -> q [n, V] over the target's, under each row's
        sampling settings (tokens outside the draft vocabulary get -inf, so q = 0)."""
        full = logits.new_full((logits.shape[0], 1, self.vocab_size), float("-inf"))  # [n, 1, V]
        full.index_copy_(2, self._ids, logits)
        return probs_from_logits(full, sampling)[:, 0]

    @property
    def forward_shapes(self) -> int:
        return 2


def _padded(x: torch.Tensor, width: int) -> torch.Tensor:
    """The first dimension of ``x`` cut or zero-padded to ``width``."""
    if x.shape[0] >= width:
        return x[:width]
    return torch.cat([x, x.new_zeros(width - x.shape[0], *x.shape[1:])])
