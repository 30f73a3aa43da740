"""The log of served requests: one row per finished routed request, in collect-router-data's
format, so that ``train-router`` learns from served traffic (``data: [rows.jsonl, served.jsonl]``).

A served row measures one drafter on its prompt (the one the router chose), where a collected
row set measures every drafter: train-router learns from the drafter that ran and leaves the
others' predictions to the collected rows. Rows are appended with ``RowStore`` (one write, then
fsync), so a crash loses at most the row being written. The same prompt served again with the
same drafter becomes the next ``repeat`` of its key.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from routing.rows import RowStore
from serving.engine import Completion
from serving.engine.engine_settings import is_model_ref

SERVED_DOMAIN = "served"


class RequestLog:
    def __init__(self, path: str | Path, *, target: str, target_weights: str, draft_refs: dict[str, str | None],
                 draft_weights: str | None = None) -> None:  # fmt: skip
        self.store = RowStore(path)
        self.target, self.target_weights, self.draft_refs = target, target_weights, dict(draft_refs)
        self.draft_weights = draft_weights

    def row(self, *, text: str, chat: bool, draft: str, choice: Any, explored: bool, k: int, occupancy: int,
            prompt_tokens: int, greedy: bool, completion: Completion, processors: tuple[str, ...] = ()) -> dict:  # fmt: skip
        """The row of one finished request (``choice``: the router's ``Choice``; ``explored``: routing.explore
        sent it to ``draft`` instead of the router's choice; ``processors``: the logits processors it used,
        ``SamplingParams.processors``, which change the target's distribution and so its acceptance)."""
        s = completion.stats
        prompt_id = f"{SERVED_DOMAIN}/{hashlib.sha256(text.encode()).hexdigest()[:16]}"
        mode = "greedy" if greedy else "sampled"
        repeat = 0
        while (prompt_id, draft, mode, repeat) in self.store:
            repeat += 1
        return {
            "prompt_id": prompt_id, "domain": SERVED_DOMAIN, "split": None, "text": text, "use_chat_template": chat,
            "prompt_tokens": prompt_tokens, "draft": draft, "draft_ref": self.draft_refs.get(draft), "target": self.target,
            "target_weights": self.target_weights,
            "draft_weights": self.draft_weights if is_model_ref(self.draft_refs.get(draft)) else None,
            # k: the request's K; mean_k: what each verification drafted (goodput and the answer's end cap it)
            "mode": mode, "repeat": repeat, "k": k, "mean_k": s["mean_k"], "batch_size": occupancy,
            "new_tokens": s["new_tokens"], "target_calls": s["target_calls"], "acceptance_rate": s["acceptance_rate"],
            "mean_accepted_length": s["mean_accepted_length"], "per_position_acceptance": s["per_position_acceptance"],
            "output_sha": hashlib.sha256(str(completion.token_ids).encode()).hexdigest()[:16],
            "finish_reason": completion.finish_reason, "draft_step_ms": s["draft_step_ms"],
            "target_step_ms": s["target_step_ms"], "draft_target_cost_ratio": s["draft_target_cost_ratio"],
            "prefill_ms": 1e3 * s["prefill_time_s"], "total_ms": 1e3 * s["total_time_s"],
            "tokens_per_second": s["tokens_per_second"], "speedup": None,  # no target-alone run to divide by
            "source": "served", "occupancy": occupancy,
            "predicted_acceptance": choice.predicted_acceptance.get(draft) if choice is not None else None,  # at collected K
            "predicted_rate_at_k": choice.expected_rate if choice is not None and not explored else None,
            "fallback": s.get("fallback"),
            "explored": explored,
            "processors": list(processors),
        }  # fmt: skip

    def append(self, row: dict) -> None:
        self.store.append(row)
