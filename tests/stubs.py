"""Stub runners with fixed logits: they stand in for ``ModelRunner`` in ``speculative_step``."""

from __future__ import annotations

import torch

from serving.engine.speculative import DecodeState


class PositionStub:
    """Greedy-style stub: after position t it strongly prefers token ``script(t + 1)``."""

    def __init__(self, vocab_size: int, script) -> None:
        self.vocab_size = vocab_size
        self.max_len = 1 << 30  # cache positions a forward may write (ModelRunner's attribute)
        self.script = script
        self.calls: list[int] = []  # input widths, to check the shapes the step asks for

    def forward(self, tokens, positions, last_only=False):
        self.calls.append(tokens.shape[1])
        if last_only:
            positions = positions[:, -1:]
        wanted = positions.clone().apply_(lambda t: self.script(t + 1))
        return torch.nn.functional.one_hot(wanted, self.vocab_size).float() * 10.0


class MarkovStub:
    """Logits depend on the input token only: ``table[token]``, a first-order Markov chain."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table  # [V, V] logits of the next token given the current one
        self.vocab_size = table.shape[0]
        self.max_len = 1 << 30

    def forward(self, tokens, positions, last_only=False):
        if last_only:
            tokens = tokens[:, -1:]
        return self.table[tokens]


def state_for(prefixes: list[list[int]], capacity: int, limit: int, eos: list[int], device="cpu") -> DecodeState:
    B = len(prefixes)
    tokens = torch.zeros(B, capacity, dtype=torch.long)
    for b, prefix in enumerate(prefixes):
        tokens[b, : len(prefix)] = torch.tensor(prefix)
    lengths = torch.tensor([len(p) for p in prefixes])
    return DecodeState(
        tokens=tokens.to(device),
        lengths=lengths.to(device),
        limits=(lengths + limit).to(device),
        done=torch.zeros(B, dtype=torch.bool, device=device),
        eos_ids=torch.tensor(eos or [-1], device=device),
    )
