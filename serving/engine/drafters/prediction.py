"""``prediction``: draft from the text the client expects, OpenAI's Predicted Outputs.

A request may carry ``"prediction": {"type": "content", "content": "..."}``: text the answer is
likely to repeat, such as the original code of a code edit. The drafter aligns the answer so far
with the prediction and proposes the prediction's next tokens. Alignment: the longest tail of the
answer (``max_n`` down to ``min_n`` tokens) found in the prediction at or after where the last
match ended, else anywhere in it (an edit may skip or reorder parts). Before a tail matches,
nothing is proposed, except at the start, where the prediction's head is.

How much it proposes depends on how sure the alignment is. A tail of ``confident_n`` tokens or
more (or an answer that so far is the prediction's head) proposes ``k`` tokens: the answer is
copying the prediction. A shorter tail of n tokens proposes n + 1: a match of one or two tokens
is often a coincidence (on the bundled code edits a one-token alignment's first proposed token
was accepted far less often than an eight-token one's: docs/experiments/q4-target.md, from
``scripts/experiments/replay_prediction.py``), and a wide verify costs several one-token steps on a
CPU. Each accepted token lengthens the next step's tail, so a real
alignment reaches ``k`` within a step or two.

Where the answer departs from the prediction the target rejects the proposal and the request
continues at the target's own pace until the answer rejoins the prediction.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from serving.engine.drafters.base import HostDrafter, RowContext


class PredictionDrafter(HostDrafter):
    kind = "prediction"

    def __init__(self, k: int | None = None, min_n: int = 1, max_n: int = 8, confident_n: int = 4) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"prediction drafter: need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        if not 1 <= confident_n <= max_n:
            raise ValueError(f"prediction drafter: confident_n={confident_n} must be in 1..max_n={max_n} (1: always propose "
                             "k tokens; no tail longer than max_n is looked for)")  # fmt: skip
        self.k, self.min_n, self.max_n, self.confident_n = k, min_n, max_n, confident_n
        self._rows: dict[int, tuple[np.ndarray, int]] = {}  # row -> (prediction ids, prompt length)
        self._cursor: dict[int, int] = {}  # row -> index in the prediction just past the last match

    def start(self, row: int, ctx: RowContext) -> None:
        if ctx.prediction:
            self._rows[row] = (np.asarray(ctx.prediction, dtype=np.int64), len(ctx.prompt))
            self._cursor[row] = 0
        else:
            self._rows.pop(row, None)

    def stop(self, row: int, finished: bool) -> None:
        self._rows.pop(row, None)
        self._cursor.pop(row, None)

    def propose(self, row: int, tokens: Sequence[int], k: int) -> list[int]:
        if row not in self._rows or k <= 0:
            return []
        pred, prompt_len = self._rows[row]
        answer = tokens[prompt_len:]
        if not answer:
            return pred[:k].tolist()
        aligned = self._align(pred, answer, self._cursor[row])
        if aligned is None:
            return []
        end, n = aligned
        self._cursor[row] = end
        sure = n >= self.confident_n or end == n == len(answer)  # a long tail, or the prediction's head so far
        return pred[end : end + (k if sure else min(k, n + 1))].tolist()

    def _align(self, pred: np.ndarray, answer: Sequence[int], cursor: int) -> tuple[int, int] | None:
        """(index just past the longest answer tail found in ``pred``, that tail's length): the
        first occurrence at or after ``cursor`` (the answer moves forward through the
        prediction), else the last one before it."""
        for n in range(min(self.max_n, len(answer), len(pred)), self.min_n - 1, -1):
            tail = np.asarray(answer[-n:], dtype=np.int64)
            windows = np.lib.stride_tricks.sliding_window_view(pred, n)  # [len(pred) - n + 1, n]
            ends = np.flatnonzero((windows == tail).all(axis=1)) + n  # [matches] index past each match
            if len(ends):
                ahead = ends[ends >= cursor]
                return int(ahead[0] if len(ahead) else ends[-1]), n
        return None
