"""Logprobs in OpenAI's response shapes, from the engine's ``TokenLogprob`` entries.

    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}, ...]}, ...]}
    completions: {"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}, ...], "text_offset": [...]}

The values are the engine's: the target's distribution after the request's logits processors and
before its temperature (vLLM's "processed" logprobs), one entry per generated token, the EOS that
ends an answer included (as vLLM does). The shapes follow vLLM's server:

* ``token`` is the token decoded alone, special tokens kept (``tokenizer.decode([id])``: the EOS
  reads ``<|im_end|>``; a token holding part of a multi-byte character reads U+FFFD);
* ``bytes`` are the token's own bytes: the raw bytes of a byte-level BPE token (or of a
  SentencePiece byte-fallback token ``<0xE2>``) whenever they decode to its ``token``, so that the
  bytes of the tokens that split a character join into it, as OpenAI promises; otherwise the UTF-8
  of ``token``;
* a logprob below -9999 (-inf: a token a processor banned, or ``min_p`` dropped) is sent as
  -9999.0, as vLLM and OpenAI send it: JSON has no infinity;
* chat's ``top_logprobs`` are the N most likely tokens, most likely first; a completion's
  ``top_logprobs`` maps the chosen token and then the N most likely to their logprobs (up to N + 1
  entries, OpenAI's and vLLM's rule; two tokens of the same text keep the first's);
* ``text_offset`` is where each token's text starts in the completion's text (a token whose bytes
  end inside a character starts where that character does), counted from the completion's first
  character across the chunks of a stream.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

from serving.engine.request import TokenLogprob

LOGPROB_FLOOR = -9999.0
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the character that stands for each byte -> the byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: b for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in chars.items()}


BYTE_DECODER = _byte_decoder()


class TokenStrings:
    """A token id's ``(token, bytes)`` as the responses show them, cached (one tokenizer, used on
    the event loop)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            hit = self._cache[token_id] = self._describe(token_id)
        return hit

    def _describe(self, token_id: int) -> tuple[str, list[int]]:
        text = self.tokenizer.decode([token_id])  # an id beyond the tokenizer's entries decodes to ""
        raw = self.tokenizer.convert_ids_to_tokens(token_id)  # the vocabulary entry; None beyond it
        data = None
        if isinstance(raw, str) and raw:
            fallback = _BYTE_FALLBACK.fullmatch(raw)
            if fallback:
                data = bytes([int(fallback[1], 16)])
            elif all(c in BYTE_DECODER for c in raw):
                data = bytes(BYTE_DECODER[c] for c in raw)
            # Only bytes that are this token's text: a vocabulary entry of another alphabet
            # (SentencePiece's "▁the", an added token) is not byte-level and falls back.
            if data is not None and data.decode("utf-8", errors="replace") != text:
                data = None
        if data is None:
            data = text.encode("utf-8", errors="replace")
        return text, list(data)


def _finite(logprob: float) -> float:
    """-9999.0 for -inf (and NaN, which fails the comparison), as vLLM sends them."""
    return float(logprob) if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def chat_logprobs(entries: Sequence[TokenLogprob], strings: Callable[[int], tuple[str, list[int]]]) -> dict:
    """``choices[0].logprobs`` of a chat completion (or of one chunk: its tokens' entries)."""
    content = []
    for e in entries:
        token, data = strings(e.token_id)
        top = [{"token": t, "logprob": _finite(lp), "bytes": b} for (t, b), lp in ((strings(i), lp) for i, lp in e.top)]
        content.append({"token": token, "logprob": _finite(e.logprob), "bytes": data, "top_logprobs": top})
    return {"content": content}


def completion_logprobs(entries: Sequence[TokenLogprob], strings: Callable[[int], tuple[str, list[int]]],
                        offsets: Sequence[int]) -> dict:  # fmt: skip
    """``choices[0].logprobs`` of a completion (or of one chunk); ``offsets``: each token's
    ``text_offset``."""
    tokens, values, tops = [], [], []
    for e in entries:
        token = strings(e.token_id)[0]
        tokens.append(token)
        values.append(_finite(e.logprob))
        top = {token: values[-1]}
        for i, lp in e.top:
            top.setdefault(strings(i)[0], _finite(lp))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": list(offsets)}


def text_offsets(texts: Sequence[str], start: int = 0) -> list[int]:
    """Where each of consecutive texts starts, the first at ``start``."""
    out = []
    for text in texts:
        out.append(start)
        start += len(text)
    return out
