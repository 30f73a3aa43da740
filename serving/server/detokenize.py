"""Incremental detokenisation for streaming: text deltas whose concatenation is the final text.

A delta may only contain text that can no longer change:

* a byte-level token can end inside a multi-byte UTF-8 character, which decodes to U+FFFD until
  the next token completes it: trailing U+FFFD is held back;
* the tail of the text may be the start of a stop string, which the finished text cuts: the
  longest tail that is a prefix of some stop string is held back.

On finish the rest comes from the engine's final text (decoded once, stop strings cut), so the
streamed text equals the non-streamed one. As in vLLM, each push decodes only a few tokens: the
text of ``ids[prefix:]`` minus that of ``ids[prefix:read]`` (decoding a window rather than the
whole sequence; the subtraction keeps tokenizers that drop a leading space right).
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.ids: list[int] = []
        self.text = ""  # decoded text that later tokens cannot change
        self.prefix = 0  # ids[prefix:read] is the context decoded again before the new tokens
        self.read = 0
        self.sent = 0  # characters of ``text`` handed out so far

    def push(self, new_ids: list[int]) -> str:
        """Add tokens; returns the text that became safe to send (maybe "")."""
        self.ids += new_ids
        decode = self.tokenizer.decode
        window = decode(self.ids[self.prefix :], skip_special_tokens=True)
        context = decode(self.ids[self.prefix : self.read], skip_special_tokens=True)
        if len(window) > len(context) and not window.endswith(_REPLACEMENT):
            self.text += window[len(context) :]
            self.prefix, self.read = self.read, len(self.ids)
        end = len(self.text) - self._stop_prefix_len(self.text)
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : end], end
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the text, given the engine's final text (which extends what was sent)."""
        return final_text[self.sent :]

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best


def fit_texts(entries: list[dict], text: str) -> list[dict]:
    """The final chunk's token entries with their texts cut to ``text`` (the final text's rest,
    which a stop string may have cut), in order; text no entry released goes to the last one."""
    out, at = [], 0
    for e in entries:
        piece = text[at : at + len(e["text"])]
        at += len(piece)
        out.append(e | {"text": piece})
    if at < len(text) and out:
        out[-1]["text"] += text[at:]
    return out


def token_texts(tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...], token_ids: list[int], final_text: str) -> list[str]:
    """The text each token releases, as a stream hands them out (``choral.tokens``), for a whole
    answer at once: the same tokens pushed one at a time, then fitted to the final text."""
    detok = IncrementalDetokenizer(tokenizer, stop)
    entries = [{"text": detok.push([t])} for t in token_ids]
    return [e["text"] for e in fit_texts(entries, final_text)]
