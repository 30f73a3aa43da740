"""The slot table: the static batch's B slots, the requests waiting for one, and what a slot holds.

A request joins the lowest free slot (so a step runs at the smallest batch bucket holding every
occupied slot) and leaves it finished, aborted or failed. A ``Slot`` keeps the request's host-side
record: its generated tokens and their origins, its generator, its statistics, its drafter. Stop
strings are applied here (``hit_stop``), and a finished slot becomes its ``Completion`` here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from serving.engine.drafters.base import PREDICTION
from serving.engine.engine_settings import EngineConfig
from serving.engine.request import Completion, Request, TokenLogprob, TokenOrigin
from serving.engine.stats import RequestStats

PRIOR_A = 0.5  # a row's per-token acceptance before it has drafted, without a router's prediction


@dataclass
class Slot:
    index: int  # the request id from add_request
    request: Request
    prompt_len: int
    generator: torch.Generator
    generated: list[int]
    origins: list[TokenOrigin]  # [len(generated)]: how each generated token came
    stats: RequestStats
    started: float
    drafter: str  # the name of the drafter the request drafts with ("none": the target alone)
    k_value: float = 0.0  # this request's own K ("auto" moves it by the request's own acceptance)
    emitted: int = 0  # tokens of ``generated`` already handed out by step()
    fell_back_at: int | None = None  # tokens generated when the row switched to the target alone
    routed_drafter: str | None = None  # the drafter the request started with, when it fell back
    prior_a: float = PRIOR_A  # per-token acceptance expected before the row's own record (step_k goodput)
    routed_prior: bool = False  # prior_a is the router's prediction (else the drafter's pooled record prices the row)
    logprobs: list[TokenLogprob] | None = None  # [len(generated)] when the request asks for logprobs

    @property
    def tokens(self) -> list[int]:
        """The row's committed tokens: prompt, then every generated one."""
        return self.request.prompt_ids + self.generated


class SlotTable:
    """B slots (None: free) and the queue of requests waiting for one, with the request ids."""

    def __init__(self, size: int) -> None:
        self.slots: list[Slot | None] = [None] * size
        self.waiting: deque[tuple[int, Request]] = deque()
        self._next_id = 0

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, b: int) -> Slot | None:
        return self.slots[b]

    def __setitem__(self, b: int, slot: Slot | None) -> None:
        self.slots[b] = slot

    def __iter__(self) -> Iterator[Slot | None]:
        return iter(self.slots)

    def queue(self, request: Request) -> int:
        """Queue a request; returns its id (unique for the table's lifetime)."""
        request_id, self._next_id = self._next_id, self._next_id + 1
        self.waiting.append((request_id, request))
        return request_id

    def unqueue(self, request_id: int) -> bool:
        for i, (rid, _) in enumerate(self.waiting):
            if rid == request_id:
                del self.waiting[i]
                return True
        return False

    def find(self, request_id: int) -> int | None:
        """The slot running request ``request_id``, if any."""
        return next((b for b, s in enumerate(self.slots) if s is not None and s.index == request_id), None)

    @property
    def running(self) -> list[int]:
        """The occupied slots."""
        return [b for b, s in enumerate(self.slots) if s is not None]

    def bucket(self, batch_buckets: tuple[int, ...]) -> int:
        """The smallest batch bucket holding every occupied slot (requests take the lowest free one)."""
        last = max(self.running, default=0)
        return next(n for n in batch_buckets if n > last)


def hit_stop(slot: Slot, before: int, tokenizer: PreTrainedTokenizerBase) -> bool:
    """True if a stop string appears in the text; cuts ``generated`` just after the token that
    completed it (tokens the step committed past it are dropped). ``before``: tokens already
    checked, so only the step's new ones are searched."""
    stops = slot.request.stop
    if not stops:
        return False
    for end in range(max(before, 1), len(slot.generated) + 1):
        text = tokenizer.decode(slot.generated[:end], skip_special_tokens=True)
        if any(s in text for s in stops):
            del slot.generated[end:]
            del slot.origins[end:]
            if slot.logprobs is not None:
                del slot.logprobs[end:]
            return True
    return False


def completion(slot: Slot, tokenizer: PreTrainedTokenizerBase, eos: set[int], now: float) -> Completion:
    """A finished slot's ``Completion``: its text cut before a stop string, why it finished, its
    statistics (the drafter it was routed to, a fallback, whether it was exact)."""
    tokens = slot.generated
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    stop_at = min((i for i in (text.find(s) for s in slot.request.stop) if i >= 0), default=-1)
    if stop_at >= 0:
        text, reason = text[:stop_at], "stop"
    elif tokens and tokens[-1] in eos:
        reason = "stop"
    else:
        reason = "length"
    slot.stats.new_tokens = len(tokens)
    slot.stats.total_time_s = now - slot.started
    params = slot.request.params
    stats = slot.stats.to_dict() | {"drafter": slot.routed_drafter or slot.drafter, "exact": not params.lossy,
                                    "verification": params.verification, "processors": list(params.processors)}  # fmt: skip
    if slot.fell_back_at is not None:
        stats["fallback"] = {"to": slot.drafter, "at_token": slot.fell_back_at}
    logprobs = None if slot.logprobs is None else list(slot.logprobs)
    return Completion(tokens, text, reason, stats, origins=list(slot.origins), logprobs=logprobs)


def host_logprobs(lp, b: int, tokens: list[int], n: int) -> list[TokenLogprob]:
    """Row ``b``'s logprobs of ``tokens`` (a step's committed tokens, in position order) from a
    ``StepLogprobs`` (``serving.engine.speculative``), with its ``n`` most likely alternatives."""
    chosen, ids, top = lp.chosen[b].tolist(), lp.top_ids[b, :, :n].tolist(), lp.top[b, :, :n].tolist()
    return [TokenLogprob(t, chosen[i], tuple(zip(ids[i], top[i]))) for i, t in enumerate(tokens)]


def drafter_of(request: Request, drafters: Mapping[str, object], default: str) -> str:
    """The drafter a request runs with: the one it names, else ``prediction`` when it carries a
    prediction (and the engine has that drafter), else the engine's default."""
    if request.drafter is not None:
        return request.drafter
    return PREDICTION if request.prediction and PREDICTION in drafters else default


def check_fits(r: Request, config: EngineConfig, drafter_names: list[str], k_max: int) -> None:
    """Refuse, by name, a request the engine cannot run (``k_max``: its largest K, 0 if it never drafts)."""
    if not r.prompt_ids:
        raise ValueError("empty prompt: give at least one token")
    if r.max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={r.max_new_tokens} must be >= 1")
    if r.drafter is not None and r.drafter not in drafter_names:
        raise ValueError(f"unknown drafter {r.drafter!r}; this engine has {', '.join(drafter_names)}")
    if r.k is not None and not 0 <= r.k <= config.k_max:
        raise ValueError(f"k={r.k} (num_speculative_tokens) must be in 0..{config.k_max}, this engine's largest K")
    need = len(r.prompt_ids) + r.max_new_tokens + k_max + 1
    if need > config.max_len:
        raise ValueError(
            f"prompt of {len(r.prompt_ids)} tokens + max_new_tokens={r.max_new_tokens} (+{k_max + 1} for "
            f"speculation) exceeds the context max_len={config.max_len}: shorten the prompt, "
            "lower max_new_tokens, or raise max_len"
        )
