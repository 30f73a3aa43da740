"""Grammar-constrained rows (JSON mode, JSON schema) with llguidance, exact under speculation.

A row with a grammar (``SamplingParams.grammar``: an llguidance grammar, e.g. from
``json_schema_grammar``) holds a matcher: the grammar's parser state after the row's committed
tokens. A step's verify masks the target's logits at each of its K + 1 positions with the tokens
the grammar allows there after the drafts before that position (a copy of the matcher walks the
drafts: ``Grammars.masks``). A draft token the grammar forbids then has p = 0 and is rejected by
the acceptance rule like any other; the residual and bonus draws come from the masked p, so the
output is distributed exactly as the constrained target alone (greedy: the same tokens). Only
``commit`` moves a matcher: the step's committed tokens, never a rejected draft.

llguidance was picked over xgrammar: no dependencies (xgrammar pulls triton), cheap matcher copies
and forced-token computation (docs/experiments/grammar-libraries.md).
"""

from __future__ import annotations

import json
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

MAX_GRAMMAR_BYTES = 256 * 1024  # a schema larger than this is refused (it would stall the step compiling)
CACHED_GRAMMARS = 64  # compiled grammars kept (one pristine matcher each, copied per request)


SEPARATORS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # llguidance's x-guidance


class GrammarError(ValueError):
    """A grammar (a JSON schema) that cannot be compiled, named with llguidance's reason."""


def json_schema_grammar(schema: dict | None) -> str:
    """The llguidance grammar of a JSON schema (None: any JSON object, OpenAI's ``json_object``),
    on one line with Python's ``json.dumps`` separators (``{"a": 1, "b": [2, 3]}``): the spacing the
    models write unconstrained (forbidding the space after a comma sent the bundled Qwen into loops),
    and no other whitespace, so a model cannot pad an answer until it runs out of tokens."""
    import llguidance

    text = json.dumps({"type": "object"} if schema is None else schema)
    return checked("the JSON schema", text, lambda: llguidance.LLMatcher.grammar_from_json_schema(text, overrides=SEPARATORS))


def checked(what: str, source: str, build: Callable[[], str]) -> str:
    """``build()``'s llguidance grammar of ``source`` (``what``: how an error names it), validated:
    a source over ``MAX_GRAMMAR_BYTES`` or one llguidance cannot compile is a ``GrammarError``."""
    import llguidance

    if len(source) > MAX_GRAMMAR_BYTES:
        raise GrammarError(f"{what} is {len(source)} bytes; at most {MAX_GRAMMAR_BYTES} are compiled")
    try:
        grammar = build()
    except ValueError as e:
        raise GrammarError(f"{what} cannot be compiled: {e}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"{what} cannot be compiled: {error}")
    return grammar


class Grammars:
    """llguidance's view of one tokenizer (its vocabulary at the logits' width) and the grammars
    compiled for it, kept per grammar text (a pristine matcher, deep-copied per request)."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf

        self.vocab_size = vocab_size
        # Logits wider than the tokenizer's vocabulary: ids past it are never allowed. Narrower (a
        # test's tiny vocabulary): the masks cover the tokenizer, ``apply_masks`` reads the logits' part.
        self.n_vocab = max(vocab_size, len(tokenizer))
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.n_vocab)
        # A GGUF-converted vocabulary names the rows that pad the embedding "[PAD<id>]" (llama.cpp's
        # converter): plain text to llguidance, so a JSON string would admit them. Never allowed.
        self.padding = sorted(i for t, i in tokenizer.get_vocab().items() if i < vocab_size and t == f"[PAD{i}]")
        keep = np.full(self.bitmask(1).shape[1], 0xFFFFFFFF, dtype=np.uint32)  # [W]
        for i in self.padding:
            keep[i // 32] &= ~np.uint32(1 << (i % 32))
        self.keep = keep.view(np.int32)
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()  # the server compiles on its event loop while the engine's thread starts rows

    def matcher(self, grammar: str) -> Any:
        """A fresh matcher of ``grammar`` (compiled once, then copied)."""
        import llguidance

        with self._lock:
            pristine = self._compiled.get(grammar)
            if pristine is None:
                pristine = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
                if pristine.is_error():
                    raise GrammarError(f"the grammar cannot be compiled: {pristine.get_error()}")
                self._compiled[grammar] = pristine
                if len(self._compiled) > CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
            self._compiled.move_to_end(grammar)
            return pristine.deep_copy()

    def bitmask(self, rows: int) -> np.ndarray:
        import llguidance.numpy

        return llguidance.numpy.allocate_token_bitmask(rows, self.n_vocab)  # [rows, ceil(n_vocab / 32)] int32

    def masks(self, matchers: Sequence[tuple[int, Any, list[int]]], B: int, T: int) -> torch.Tensor:
        """[B * T, W] bitmasks: row b's position t allows what its grammar allows after its drafts
        before t (``matchers``: (row, matcher, drafts)); every other entry allows every token.

        A copy of each matcher walks its row's drafts while they are allowed; the matcher itself only
        computes position 0, so it leaves as it came. (llguidance's rollback, and its one-call
        ``fill_next_token_bitmask_par_with_draft_tokens``, left a matcher advanced after a mask for
        grammars of token ids such as ``<[151657]>``, a tool call's tag: llguidance 1.9.1.)"""
        import llguidance.numpy

        bitmask = self.bitmask(B * T)
        bitmask.fill(-1)
        for b, m, drafts in matchers:
            drafts = drafts[: T - 1]
            llguidance.numpy.fill_next_token_bitmask(m, bitmask, b * T)
            walker = m.deep_copy() if drafts else None  # advanced along the drafts, then dropped
            for i, t in enumerate(drafts):
                if not (int(bitmask[b * T + i, t >> 5]) >> (t & 31)) & 1 or not walker.consume_token(t):
                    break  # a forbidden draft: rejected there, the positions after it are never read
                llguidance.numpy.fill_next_token_bitmask(walker, bitmask, b * T + i + 1)
            if self.padding:
                bitmask[b * T:(b + 1) * T] &= self.keep
        return torch.from_numpy(bitmask)


_BY_TOKENIZER: "weakref.WeakKeyDictionary[Any, Grammars]" = weakref.WeakKeyDictionary()


def grammars_for(tokenizer: Any, vocab_size: int) -> Grammars:
    """The ``Grammars`` of a tokenizer (built on first use: about a second for a 150K vocabulary)."""
    g = _BY_TOKENIZER.get(tokenizer)
    if g is None or g.vocab_size != vocab_size:
        g = _BY_TOKENIZER[tokenizer] = Grammars(tokenizer, vocab_size)
    return g


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` [B, T, V] with every token a bitmask ([B * T, W] int32) disallows set to -inf."""
    B, T, V = logits.shape
    bits = torch.arange(32, dtype=torch.int32)
    allowed = ((bitmask.unsqueeze(-1) >> bits) & 1).bool().view(B * T, -1)[:, :V]  # [B * T, V] (the mask may be wider)
    return logits.masked_fill(~allowed.view(B, T, V).to(logits.device), float("-inf"))
