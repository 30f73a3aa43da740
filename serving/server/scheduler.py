"""Continuous batching over the engine: one thread owns it and steps it.

    scheduler = Scheduler(engine, router, metrics)
    scheduler.start()
    forced = scheduler.check_draft(name)   # a drafter a client names: refused unless the engine has it
    ticket = Ticket(request, route_text="def add(a, b):", loop=asyncio.get_running_loop(), forced_draft=forced)
    scheduler.submit(ticket)           # from any thread; events arrive on ticket.events
    await ticket.events.get()          # Routed(draft, choice) or Failed(error)

One engine (one target, one KV cache, one batch) holds every drafter; each row drafts with its
request's: routing a request to a drafter sets its ``Request.drafter``. The valid drafter names
are the engine's (``engine.drafter_names``, ``none`` the target alone): a name a client forces is
checked against them by ``check_draft``, and the router's names once, when the scheduler is made.
The engine is not thread-safe, so everything that touches it happens on the scheduler's thread;
asyncio handlers talk to it through a thread-safe inbox and get events back via
``loop.call_soon_threadsafe``.

Between steps the thread routes new requests (one ``choose_batch`` for all that arrived, for the
batch they join), checks the queue limit, aborts cancelled and timed-out requests, then runs one
engine step and hands each request its new tokens. A routed request drafts with the router's
drafter and K and carries its fallback floor (``RoutingSettings``); when it finishes, its row goes
to the request log, if there is one.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from serving.engine import Completion, Request, RequestFailed, StepOutput
import torch

from serving.engine.drafters.base import NONE
from serving.engine.drafters.registry import AUTO
from serving.engine.goodput import per_token_acceptance
from serving.engine.request import Fallback
from serving.server.admission import FairQueue
from serving.server.metrics import ServerMetrics
from serving.server.openai_api import APIError
from serving.server.serve_config import RoutingSettings

log = logging.getLogger("choral.scheduler")
ENGINE = "engine"  # the label of the engine's step metrics (the one engine holds every drafter)


class EngineLimits(Protocol):
    k: int | str  # the engine's K (an int, or "auto")
    k_max: int  # the largest K a row may draft


class Engine(Protocol):
    """The incremental API of ``SpeculativeEngine`` (fused, or with its target behind gRPC) that the scheduler uses."""

    drafter_names: Sequence[str]  # every drafter a row may draft with, "none" (the target alone) included
    config: EngineLimits

    def add_request(self, request: Request) -> int: ...
    def step(self) -> list[StepOutput]: ...
    def abort_request(self, request_id: int) -> bool: ...
    def has_unfinished_requests(self) -> bool: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_waiting(self) -> int: ...


@runtime_checkable
class RouteChoice(Protocol):
    """A router's choice for one request, as the scheduler applies it (``routing.router.Choice``)."""

    draft: str  # a drafter name; "none" the target alone
    k: int  # the K the router suggests
    predicted_acceptance: dict[str, float]  # per drafter, at the router's collected K
    expected_rate: float  # the chosen drafter's predicted acceptance rate at ``k``

    def fallback_floor(self, ratio: float) -> float: ...


@runtime_checkable
class Router(Protocol):
    """What the scheduler asks of a router (``routing.router.Router``). Checked when the scheduler
    is made: a router lacking a member is refused by name, never silently routed without it."""

    draft_names: Sequence[str]
    collected_k: int  # the K its predicted acceptance rates are at

    def choose_batch(self, prompts: list[str], occupancy: int = 1,
                     prompt_tokens: Sequence[int] | None = None) -> list[RouteChoice]: ...  # fmt: skip
    def rate_at(self, rate: float, k: int) -> float: ...


def missing_members(obj: Any, protocol: type) -> list[str]:
    """The members of ``protocol`` that ``obj`` lacks (the protocol's attributes and methods)."""
    names = getattr(protocol, "__protocol_attrs__", None) or {
        n for n in (*protocol.__dict__, *getattr(protocol, "__annotations__", {})) if not n.startswith("_")}  # fmt: skip
    return sorted(n for n in names if not hasattr(obj, n))


# ---- events a ticket receives ---------------------------------------------------------------


@dataclass
class Routed:
    draft: str
    choice: Any  # routing.Choice, or None without a router
    k: int | None = None  # the K the request drafts with (the router's); None: the engine's
    explored: bool = False  # routing.explore sent it to another drafter than the router's choice


@dataclass
class Tokens:
    ids: list[int]
    origins: list | None = None  # [len(ids)] the engine's TokenOrigin of each
    logprobs: list | None = None  # [len(ids)] the engine's TokenLogprob of each, when the request asked


@dataclass
class Finished:
    completion: Completion


@dataclass
class Failed:
    error: APIError


@dataclass(eq=False)
class Ticket:
    """One request's passage through the scheduler. ``stream``: whether to send Tokens events (a
    non-streaming handler only needs the end)."""

    request: Request
    route_text: str
    loop: asyncio.AbstractEventLoop
    forced_draft: str | None = None
    stream: bool = False
    chat: bool = True  # the prompt came as chat messages (for the request log)
    timeout_s: float = 300.0
    client: str = "addr:unknown"  # who sent it (serving.server.admission.client_id): its line in the fair queue
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    arrived: float = field(default_factory=time.perf_counter)
    # Set on the scheduler thread:
    draft: str | None = None
    request_id: int | None = None
    choice: Any = None  # the router's Choice
    occupancy: int = 1  # the batch the request joined (itself included), as the router saw it
    explored: bool = False  # routing.explore drew another drafter than the router's choice
    first_token: float | None = None
    last_token: float | None = None
    done: bool = False

    def send(self, event: Routed | Tokens | Finished | Failed) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the handler's loop is gone (server shutting down)
            pass


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        router: Any = None,
        metrics: ServerMetrics | None = None,
        *,
        max_batch_size: int = 8,
        queue_limit: int = 64,
        per_client_limit: int | None = None,
        unavailable: tuple[type[BaseException], ...] = (),
        routing: RoutingSettings | None = None,
        request_log: Any = None,
    ) -> None:
        """engine: holds every drafter (``engine.drafter_names``).
        router: a routing.Router whose choices name the engine's drafters (None: every request
        drafts with the engine's first drafter unless forced).
        unavailable: exceptions of ``step`` that mean the remote target is down (HTTP 503).
        routing: how a choice applies (K, load, fallback); request_log: a ``RequestLog`` or None."""
        self.engine = engine
        self.drafter_names = tuple(engine.drafter_names)
        if router is not None and (lacks := missing_members(router, Router)):
            raise TypeError(f"the router lacks {', '.join(lacks)}, which the scheduler routes with: give a "
                            "routing.router.Router (or an object with every member of scheduler.Router)")  # fmt: skip
        if router is not None and (unknown := [d for d in router.draft_names if d not in self.drafter_names]):
            raise ValueError(f"the router chooses drafters {unknown} that the engine does not have (it has "
                             f"{', '.join(self.drafter_names)}): build the engine from the router's drafters")  # fmt: skip
        self.router = router
        self.metrics = metrics or ServerMetrics()
        self.max_batch_size = max_batch_size
        # Requests routed and waiting for a slot, a line per client (None: no per-client limit).
        self.waiting = FairQueue(queue_limit, per_client_limit if per_client_limit is not None else queue_limit + max_batch_size)
        self.unavailable = unavailable
        self.routing = routing or RoutingSettings()
        self._explore_rng = random.Random(self.routing.explore_seed)
        self.request_log = request_log
        self._drift: dict[str, float] = {}  # per draft: moving average of live - predicted acceptance
        self._inbox: queue.SimpleQueue[tuple[str, Ticket | None]] = queue.SimpleQueue()
        self._tickets: dict[int, Ticket] = {}  # the engine's request id -> ticket
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- any thread ----------------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="choral-scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._inbox.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout)

    def check_draft(self, name: str | None) -> str | None:
        """The one check of a drafter name a request forces: ``name`` if the engine has that drafter
        (or None: the router chooses); otherwise a 400 naming the bad value and the valid names.
        Reads only what never changes: safe from any thread, before the request is tokenized."""
        if name is not None and name not in self.drafter_names:
            raise APIError(400, f"unknown draft {name!r}; choose one of {', '.join(self.drafter_names)}", param="draft",
                           code="unknown_draft")  # fmt: skip
        return name

    def submit(self, ticket: Ticket) -> None:
        self._inbox.put(("add", ticket))

    def abort(self, ticket: Ticket) -> None:
        """Cancel a request (its client went away): its slot is freed before the next step."""
        self._inbox.put(("abort", ticket))

    # ---- the scheduler thread ------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._drain_inbox(block=not self.engine.has_unfinished_requests() and not len(self.waiting))
                self._expire()
                if self.engine.has_unfinished_requests():
                    self._step()
                self._feed()  # slots freed by the step, or by cancels and timeouts
                self.metrics.queue_depth.set(self.engine.num_waiting + len(self.waiting))
                self.metrics.running.set(self.engine.num_running)
            except Exception as e:
                # A dead scheduler thread would leave every request hanging: fail what is in
                # flight with the cause and keep serving.
                log.exception("scheduler loop failed")
                for ticket in list(self._tickets.values()):
                    self._fail(ticket, APIError(500, f"internal error: {type(e).__name__}: {e}"), "error")
        for ticket in [*self._tickets.values(), *self.waiting]:
            self._fail(ticket, APIError(503, "the server is shutting down"), "shutdown")

    def _drain_inbox(self, block: bool) -> None:
        added: list[Ticket] = []
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
            while True:
                kind, ticket = item
                if kind == "add":
                    added.append(ticket)
                elif kind == "abort" and ticket is not None:
                    if ticket in added:
                        added.remove(ticket)
                        self.metrics.finished.labels("cancelled").inc()
                    else:
                        self._cancel(ticket)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass
        if added:
            self._admit(added)

    def _admit(self, tickets: list[Ticket]) -> None:
        choices: list[Any] = [None] * len(tickets)
        # Forced requests skip the router: embedding their prompts would only delay the next step.
        routed = [i for i, t in enumerate(tickets) if t.forced_draft is None]
        occupancy = 1
        if self.routing.load_aware:  # the batch these requests join: what runs and waits, and themselves
            load = self.engine.num_running + self.engine.num_waiting + len(self.waiting)
            occupancy = max(1, min(self.max_batch_size, load + len(routed)))
        # A seeded sampled request is routed as if alone: its drafter and K shape its draws, which must
        # not depend on what else is in the batch (the engine never caps its K for the same reason).
        # Greedy output is the target's whatever the drafter, so those follow the load.
        def routed_at(ticket: Ticket) -> int:
            return 1 if ticket.request.params.seeded_sampling else occupancy

        at = {i: routed_at(tickets[i]) for i in routed}
        if self.router is not None and routed:
            try:
                for b in sorted(set(at.values())):
                    group = [i for i in routed if at[i] == b]
                    texts = [tickets[i].route_text for i in group]
                    lengths = [len(tickets[i].request.prompt_ids) for i in group]  # to price the prefills
                    for i, c in zip(group, self.router.choose_batch(texts, b, lengths)):
                        choices[i] = c
            except Exception as e:  # a broken router must not take the server down
                log.exception("routing failed")
                for i in routed:
                    self._fail(tickets[i], APIError(500, f"routing failed: {type(e).__name__}: {e}"), "error")
                keep = [i for i in range(len(tickets)) if i not in set(routed)]
                tickets, choices = [tickets[i] for i in keep], [None] * len(keep)
        for ticket, choice in zip(tickets, choices):
            draft = ticket.forced_draft or (choice.draft if choice is not None else self.drafter_names[0])
            if choice is not None and ticket.forced_draft is None:
                draft = self._explore(draft)
                ticket.explored = draft != choice.draft
            free = self.max_batch_size - self.engine.num_running - self.engine.num_waiting
            if (why := self.waiting.refusal(ticket.client, free)) is not None:
                self._fail(ticket, APIError(429, why[1], code=why[0]), "rejected")
                continue
            ticket.request.drafter = draft  # the row drafts with it inside the shared batch
            if draft == AUTO and choice is not None:  # the router's predictions are auto's priors
                ticket.request.drafter_priors = self._priors(choice)
            if choice is not None and ticket.forced_draft is None and draft == choice.draft != NONE:
                self._apply_choice(ticket.request, choice)  # an explored drafter drafts the engine's K
            ticket.choice, ticket.occupancy, ticket.draft = choice, routed_at(ticket), draft
            self.waiting.push(ticket)
            ticket.send(Routed(draft, choice, ticket.request.k, ticket.explored))
            self._feed()  # at once while slots are free: the queue limit counts only what really waits

    def _feed(self) -> None:
        """Start waiting requests while the engine has free slots, in the fair queue's order: the
        engine's own queue stays empty, so who runs next is decided here."""
        while self.engine.num_running + self.engine.num_waiting < self.max_batch_size:
            ticket = self.waiting.pop()
            if ticket is None:
                return
            try:
                ticket.request_id = self.engine.add_request(ticket.request)
            except ValueError as e:
                self.waiting.ended(ticket)
                self._fail(ticket, APIError(400, str(e), param="max_tokens"), "rejected")
                continue
            self._tickets[ticket.request_id] = ticket
            self.metrics.draft_choices.labels(ticket.draft, str(ticket.forced_draft is not None).lower()).inc()
            for processor in ticket.request.params.processors:
                self.metrics.processor_requests.labels(processor).inc()
            if ticket.explored:
                self.metrics.explored.labels(ticket.choice.draft).inc()
            self.metrics.prompt_tokens.inc(len(ticket.request.prompt_ids))

    def _priors(self, choice: Any) -> dict[str, float]:
        """The router's predicted acceptance of each drafter as the per-token acceptance ``auto``
        starts each of them from (the rate is the router's at its collected K)."""
        collected = self.router.collected_k
        out = {}
        for name, rate in choice.predicted_acceptance.items():
            if name != NONE and collected:
                out[name] = float(per_token_acceptance(torch.tensor([float(rate)]), int(collected)))
        return out

    def _explore(self, chosen: str) -> str:
        """With probability ``routing.explore``, another of the router's drafters, uniformly: served
        rows then measure drafters the router would not have picked (what a log of its own choices
        alone can never teach it). Never ``none``: a row of the target alone measures no drafter,
        so train-router has nothing to learn from it."""
        if not self.routing.explore or self._explore_rng.random() >= self.routing.explore:
            return chosen
        others = [d for d in self.router.draft_names if d not in (chosen, NONE)]
        if not others:
            return chosen
        return others[self._explore_rng.randrange(len(others))]

    def _apply_choice(self, request: Request, choice: Any) -> None:
        """The router's K (within what the engine can verify) and the fallback floor: the lower of
        the drafter's break-even acceptance and ``fallback_ratio`` of its prediction."""
        config = self.engine.config
        if self.routing.apply_k and choice.k and config.k_max:
            request.k = min(int(choice.k), config.k_max)
        # step_k goodput's prior for the row: the predicted rate at the K the row will draft.
        k = request.k or (config.k if isinstance(config.k, int) and config.k else choice.k)
        rate = choice.predicted_acceptance.get(choice.draft)
        if rate is not None and k:
            at_k = choice.expected_rate if k == choice.k or self.router is None else self.router.rate_at(rate, int(k))
            request.expected_acceptance = at_k
        ratio = self.routing.fallback_ratio
        if ratio is not None:
            floor = choice.fallback_floor(ratio)
            if floor > 0:
                request.fallback = Fallback(min_acceptance=floor, after_drafted=self.routing.fallback_after,
                                            confidence=self.routing.fallback_confidence)

    def _step(self) -> None:
        started = time.perf_counter()
        try:
            outputs = self.engine.step()
        except RequestFailed as e:
            # Requests that failed alone (the engine found their rows); the others go on next step.
            log.error("engine: %s", e)
            for rid, error in e.errors.items():
                ticket = self._tickets.get(rid)
                if ticket is not None:
                    self._fail(ticket, APIError(500, f"the request failed in the engine: {type(error).__name__}: {error}",
                                                code="request_failed"), "error")  # fmt: skip
            return
        except self.unavailable as e:
            # The engine names the requests its remote target failed (the others go on next step); a
            # failure that names none takes the whole engine's requests with it.
            error = APIError(503, f"the target is unavailable: {e}", code="target_unavailable")
            self._fail_running(error, getattr(e, "request_ids", None))
            return
        except Exception as e:
            log.exception("the engine failed a step")
            self._fail_running(APIError(500, f"the engine failed a step: {type(e).__name__}: {e}"))
            return
        now = time.perf_counter()
        self.metrics.engine_steps.labels(ENGINE).inc()
        self.metrics.step_time.labels(ENGINE).observe(now - started)
        for out in outputs:
            ticket = self._tickets.get(out.request_id)
            if ticket is None:
                continue
            if out.new_token_ids:
                self._observe_tokens(ticket, len(out.new_token_ids), now)
            if out.finished is not None:
                self._finish(ticket, out.finished, now)
            elif out.new_token_ids and ticket.stream:
                ticket.send(Tokens(out.new_token_ids, out.new_token_origins, out.new_token_logprobs))

    def _observe_tokens(self, ticket: Ticket, n: int, now: float) -> None:
        if ticket.first_token is None:
            ticket.first_token = now
            self.metrics.ttft.observe(now - ticket.arrived)
            n -= 1
        elif n:
            # A speculative step commits several tokens at once: spread its gap over them.
            gap = (now - ticket.last_token) / n
            for _ in range(n):
                self.metrics.itl.observe(gap)
        ticket.last_token = now

    def _finish(self, ticket: Ticket, completion: Completion, now: float) -> None:
        self._tickets.pop(ticket.request_id, None)
        self.waiting.ended(ticket)
        ticket.done = True
        s, m, draft = completion.stats, self.metrics, ticket.draft
        m.generated_tokens.labels(draft).inc(len(completion.token_ids))
        m.drafted_tokens.labels(draft).inc(s.get("drafted", 0))
        m.accepted_tokens.labels(draft).inc(s.get("accepted", 0))
        m.drafts.labels(draft).inc(s.get("drafts", 0))
        m.target_calls.labels(draft).inc(s.get("target_calls", 0))
        m.capped_steps.labels(draft).inc(s.get("capped_steps", 0))
        for drafter, share in s.get("drafter_shares", {}).items():
            m.drafter_steps.labels(draft, drafter).inc(round(share * s.get("target_calls", 0)))
        m.grammar_tokens.inc(sum(1 for o in completion.origins or () if o.origin == "draft" and o.drafter == "grammar"))
        if s.get("drafted"):
            m.acceptance.labels(draft).observe(s["acceptance_rate"])
        if s.get("fallback"):
            m.fallbacks.labels(draft).inc()
        choice = ticket.choice if ticket.forced_draft is None else None
        if choice is not None and draft != NONE and s.get("drafted"):
            predicted = choice.expected_rate if ticket.request.k else choice.predicted_acceptance.get(draft, 0.0)
            m.predicted_acceptance.labels(draft).observe(predicted)
            m.chosen_k.labels(draft).observe(ticket.request.k or s.get("mean_k", 0.0))
            drift = self._drift.get(draft, 0.0) * 0.95 + 0.05 * (s["acceptance_rate"] - predicted)  # ~20-request average
            self._drift[draft] = drift
            m.acceptance_error.labels(draft).set(drift)
        m.e2e.observe(now - ticket.arrived)
        m.finished.labels(completion.finish_reason).inc()
        m.verification.labels(s.get("verification", "exact")).inc()
        # A lossy request's acceptance is not its drafter's: it would teach the router a false rate.
        if self.request_log is not None and choice is not None and s.get("exact", True):
            self._log(ticket, completion)
        ticket.send(Finished(completion))

    def _log(self, ticket: Ticket, completion: Completion) -> None:
        """Append the request's row; a log that cannot be written costs the row, never the request."""
        r = ticket.request
        # The K it drafted with: the router's, else (an explored or unrouted K) the mean it drafted.
        k = r.k or round(completion.stats.get("mean_k", 0.0))
        try:
            self.request_log.append(self.request_log.row(
                text=ticket.route_text, chat=ticket.chat, draft=ticket.draft, choice=ticket.choice,
                explored=ticket.explored, k=k, occupancy=ticket.occupancy, prompt_tokens=len(r.prompt_ids),
                greedy=r.params.greedy, completion=completion, processors=r.params.processors))  # fmt: skip
            self.metrics.logged_rows.inc()
        except Exception:
            log.exception("could not write the request log's row")

    def _cancel(self, ticket: Ticket) -> None:
        if ticket.done or not (self._release(ticket) or self.waiting.remove(ticket)):
            return
        ticket.done = True
        self.metrics.finished.labels("cancelled").inc()

    def _release(self, ticket: Ticket) -> bool:
        """Free a started request's slot (and its client's count); False if it had not started."""
        if ticket.request_id is None or ticket.request_id not in self._tickets:
            return False
        self.engine.abort_request(ticket.request_id)
        self._tickets.pop(ticket.request_id, None)
        self.waiting.ended(ticket)
        return True

    def _fail(self, ticket: Ticket, error: APIError, reason: str) -> None:
        if not ticket.done and not self._release(ticket):
            self.waiting.remove(ticket)
        ticket.done = True
        self.metrics.finished.labels(reason).inc()
        ticket.send(Failed(error))

    def _fail_running(self, error: APIError, request_ids: list[int] | None = None) -> None:
        """The engine's requests (or only ``request_ids``) get the error; their slots are freed
        so the engine serves new requests once the cause (e.g. a restarting target) is gone."""
        for rid, ticket in list(self._tickets.items()):
            if request_ids is None or rid in request_ids:
                self._fail(ticket, error, "error")

    def _expire(self) -> None:
        now = time.perf_counter()
        for ticket in [*self._tickets.values(), *self.waiting]:
            if now - ticket.arrived > ticket.timeout_s:
                self._fail(ticket, APIError(
                    504, f"the request did not finish within request_timeout_s={ticket.timeout_s:g} s",
                    code="request_timeout"), "timeout")  # fmt: skip
