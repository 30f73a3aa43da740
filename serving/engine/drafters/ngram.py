"""Prompt-lookup decoding: propose the tokens that followed an earlier occurrence of the context's last n-gram.

The same drafter as vLLM's ``ngram`` speculative method (``prompt_lookup_min`` / ``prompt_lookup_max``) and
transformers' ``prompt_lookup_num_tokens``: no model, no state, just a search of the request's own tokens.
It pays off when the output copies spans of the input (code edits, quoting, summaries, retrieval answers).

Two entry points that give the same proposals:

* :func:`propose_ngram` -- a pure function of the context; one numpy pass over it, O(len(context)).
* :class:`NgramIndex` -- keeps a hash of every n-gram's occurrence as tokens arrive, so a step costs
  O(max_n - min_n + 1) to update and O(max_n + k) to propose, whatever the context length.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import numpy as np

from serving.engine.drafters.base import HostDrafter, RowContext

Match = Literal["earliest", "latest"]
_MATCHES = ("earliest", "latest")


def _check_args(k: int | None, min_n: int, max_n: int, match: str) -> None:
    if k is not None and k < 0:
        raise ValueError(f"k={k} is negative: pass the number of tokens to propose, k >= 0 (0 proposes nothing)")
    if min_n < 1:
        raise ValueError(f"min_n={min_n} must be >= 1: an n-gram needs at least one token to match")
    if max_n < min_n:
        raise ValueError(f"max_n={max_n} is below min_n={min_n}: pass 1 <= min_n <= max_n")
    if match not in _MATCHES:
        raise ValueError(f"match={match!r} is not one of {_MATCHES}")


def propose_ngram(context: Sequence[int], k: int, min_n: int = 1, max_n: int = 4, *,
                  match: Match = "earliest") -> list[int]:
    """Propose up to ``k`` tokens by copying what followed an earlier occurrence of the context's tail.

    For n from ``max_n`` down to ``min_n``, the last n tokens of ``context`` are the pattern; the first n that
    occurs earlier in ``context`` wins (a longer pattern is stronger evidence that the copy continues), and
    the proposal is the up to ``k`` tokens that followed that occurrence, fewer when the context ends first.
    Occurrences may overlap the trailing pattern (``[5, 5, 5]`` with n=2 proposes ``[5]``), never be it.

    Which occurrence, when the pattern occurs several times:

    * ``match="earliest"`` (default) -- the first occurrence in the context. This is what vLLM's ngram
      proposer does (its KMP scan over the reversed context keeps the match farthest from the end, see
      ``vllm/v1/spec_decode/ngram_proposer.py``) and what transformers' prompt lookup does, so acceptance
      numbers compare like for like. It also gives the longest drafts in periodic text, since the copy
      source is far from the end of the context.
    * ``match="latest"`` -- the most recent earlier occurrence: tracks the text being copied right now
      (e.g. the latest version of a line that an edit repeats), at the cost of shorter drafts when the
      source is close to the end.

    Args:
        context: token ids, prompt and generated so far (a list, tuple or 1-D integer numpy array).
        k: how many tokens to propose at most; 0 proposes nothing.
        min_n, max_n: the n-gram lengths tried, ``1 <= min_n <= max_n``.
        match: ``"earliest"`` or ``"latest"``, see above.

    Returns:
        The proposed token ids (a new list; ``[]`` when no n in [min_n, max_n] has an earlier occurrence).

    Cost: one vectorised comparison over the context, then work proportional to the occurrences of the last
    token times ``max_n``; converting a Python list to numpy is the main cost for lists of a few thousand
    tokens (pass an ``np.ndarray`` to skip it, or use :class:`NgramIndex` for O(1) per step).
    """
    _check_args(k, min_n, max_n, match)
    arr = context if isinstance(context, np.ndarray) else np.fromiter(context, dtype=np.int64, count=len(context))
    if arr.ndim != 1:
        raise ValueError(f"context has shape {arr.shape}: pass a 1-D sequence of token ids")
    size = arr.shape[0]
    # An earlier occurrence of an n-gram plus one token after it needs n + 1 tokens.
    if k == 0 or size < min_n + 1:
        return []
    # Candidate occurrence ends: every earlier position holding the last token. The trailing occurrence
    # (end = size - 1) is excluded by slicing, so each candidate has at least one token after it.
    ends = np.flatnonzero(arr[:-1] == arr[-1])
    if ends.size == 0:
        return []
    best_len, best_ends = 1, ends
    # Extend the match backwards one token at a time, keeping only the candidates that still agree; the
    # survivors after step j are the occurrences of the last j + 1 tokens.
    for j in range(1, max_n):
        ends = ends[ends >= j]
        if ends.size == 0:
            break
        ends = ends[arr[ends - j] == arr[size - 1 - j]]
        if ends.size == 0:
            break
        best_len, best_ends = j + 1, ends
    if best_len < min_n:
        return []
    end = int(best_ends[0] if match == "earliest" else best_ends[-1])
    return arr[end + 1:end + 1 + k].tolist()


class NgramIndex:
    """Incremental prompt lookup for one request: the same proposals as :func:`propose_ngram`, O(1) per step.

    Keeps, for every n in [min_n, max_n], a dict from each n-gram seen to the end position of its first
    (``match="earliest"``) or latest (``match="latest"``) occurrence, and for the context's trailing n-gram
    the earlier occurrence chosen when it arrived. Appending a token costs O(max_n - min_n + 1) dict
    operations; :meth:`propose` costs O(max_n + k). Memory: one dict entry per (position, n), i.e.
    (max_n - min_n + 1) * len(context) entries, plus the tokens themselves.

    The context only grows (speculative decoding appends accepted tokens; rejected drafts never enter it).
    """

    def __init__(self, tokens: Iterable[int] = (), min_n: int = 1, max_n: int = 4, *, match: Match = "earliest"):
        _check_args(None, min_n, max_n, match)
        self.min_n, self.max_n, self.match = min_n, max_n, match
        self._tokens: list[int] = []
        self._seen: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n - min_n + 1)]
        # For each n: end position of the chosen earlier occurrence of the trailing n-gram, or -1 for none.
        self._source: list[int] = [-1] * (max_n - min_n + 1)
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self._tokens)

    @property
    def tokens(self) -> list[int]:
        """The context so far (a copy)."""
        return list(self._tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens (the prompt, then each step's accepted tokens) to the context."""
        toks, seen, source = self._tokens, self._seen, self._source
        min_n, latest = self.min_n, self.match == "latest"
        for tok in tokens:
            toks.append(int(tok))
            end = len(toks) - 1
            for i, table in enumerate(seen):
                n = min_n + i
                if n > end + 1:
                    source[i] = -1
                    continue
                gram = tuple(toks[end + 1 - n:])
                prev = table.get(gram, -1)
                source[i] = prev
                if latest or prev < 0:
                    table[gram] = end

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the chosen earlier occurrence of the longest matching n-gram."""
        if k < 0:
            raise ValueError(f"k={k} is negative: pass the number of tokens to propose, k >= 0 (0 proposes nothing)")
        if k == 0:
            return []
        for i in range(len(self._source) - 1, -1, -1):
            end = self._source[i]
            if end >= 0:
                return self._tokens[end + 1:end + 1 + k]
        return []


class NgramDrafter(HostDrafter):
    """The engine's ``ngram`` drafter: an ``NgramIndex`` per row over the request's prompt and output."""

    kind = "ngram"

    def __init__(self, k: int | None = None, min_n: int = 1, max_n: int = 4, *, match: Match = "earliest") -> None:
        _check_args(k, min_n, max_n, match)
        self.k, self.min_n, self.max_n, self.match = k, min_n, max_n, match
        self._rows: dict[int, NgramIndex] = {}

    def start(self, row: int, ctx: RowContext) -> None:
        self._rows[row] = NgramIndex(ctx.prompt, self.min_n, self.max_n, match=self.match)

    def observe(self, row: int, new_tokens: Sequence[int], hidden=None) -> None:
        self._rows[row].extend(new_tokens)

    def propose(self, row: int, tokens: Sequence[int], k: int) -> list[int]:
        return self._rows[row].propose(k)

    def stop(self, row: int, finished: bool) -> None:
        self._rows.pop(row, None)
