"""``grammar``: draft only what a row's grammar forces (JSON schema keys, punctuation, enum tails).

A row with a grammar (``response_format``) gets the tokens its grammar forces next from the engine
(``serving.engine.drafting``: llguidance's fast-forward tokens), joined with its drafter's own
proposal. This drafter proposes nothing of its own, so its rows draft the forced tokens alone:
free to propose, never rejected where the mask allows one token only. A row without a grammar
runs as the target alone. Useful where a grammar forces much of the answer and no other drafter
knows the rest (and as the baseline of what the forced tokens alone give).
"""

from __future__ import annotations

from collections.abc import Sequence

from serving.engine.drafters.base import HostDrafter


class GrammarDrafter(HostDrafter):
    kind = "grammar"

    def propose(self, row: int, tokens: Sequence[int], k: int) -> list[int]:
        return []  # the engine drafts the row's forced tokens; nothing else is known for sure
