"""Choral's front over pools of vLLM replicas: ``serve --backend vllm --fleet fleet.yaml``.

A target that needs tensor parallelism, paged attention or the Trainium plugin runs in vLLM, and
vLLM runs one speculative configuration per server. The fleet file (``serving.fleet.fleet_file``)
gives each pool of replicas one; this front keeps Choral's HTTP API (OpenAI's formats, the API
key, ``/metrics``, the ``choral`` object) and sends each request to a replica of the pool the
router ranks first:

1. **Rank the pools.** The router predicts each drafter's acceptance for the prompt; a pool's
   predicted speedup is the tokens one of its steps commits at its K, over the step's measured
   cost (``PoolSettings.step_cost``); ``none`` is 1. Without a router, the fleet file's order.
   With a measured profile (``FleetConfig.profile``) the cost is the profile's step time at the
   load the pool's least-loaded replica has now, plus this request: under load a verify of K + 1
   tokens per row costs more next to a plain step than it does alone, so a busy drafting pool
   gives way to the target alone for the prompts it would speed up least.
2. **Pick a replica.** In the first pool that has one up and below ``max_inflight``, the replica
   with the least load: the requests this front has on it, or the queue vLLM reports in its own
   ``/metrics`` (``vllm:num_requests_running`` + ``vllm:num_requests_waiting``), whichever is
   larger. Pools passed over are counted (``choral_pool_fallbacks_total``, reason ``down`` or
   ``saturated``) and named in the response's ``choral.fallback``.
3. **Forward** the request body unchanged but for ``model`` (the id the replica serves) and
   Choral's own ``draft`` field. A replica that refuses the connection is marked down and the
   next candidate gets the request (nothing was generated yet); a replica that dies mid-request
   fails that request alone with a 502 (or an error event on a stream) and is marked down.
4. **Watch** every replica: ``/health`` and ``/metrics`` each ``health_interval_s``. A replica
   is used once it has answered ``/health`` and shown, in ``/v1/models``, the fleet's model and,
   in ``/metrics``, speculative counters exactly when its pool drafts; one that serves something
   else is never used, and the error names it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import httpx
import torch
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.parser import text_string_to_metric_families
from starlette.requests import Request as HTTPRequest

from routing.router import Router
from serving.engine.goodput import expected_tokens, per_token_acceptance
from serving.config import ConfigError, load_config
from serving.engine.models import resolve_model_ref
from serving.fleet.fleet_file import NONE, FleetConfig, PoolSettings
from serving.fleet.profile import Profile, load_profile, step_ms
from serving.server.http import check_model, json_error, not_ready, read_body, requested_draft, wait_disconnect
from serving.server.metrics import ServerMetrics
from serving.server.openai_api import (
    APIError, ChatCompletionRequest, CompletionRequest, OversizedInt, new_id, parse_json, sse, validate_request,
)  # fmt: skip
from serving.server.serve_config import ServeConfig

log = logging.getLogger("choral.fleet")

# vLLM's own metric names (v1 engine): the queue, and the counters it exports only when it drafts.
RUNNING, WAITING, SPEC_DRAFTS = "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:spec_decode_num_drafts"
CHORAL_FIELDS = ("draft", "verification", "verification_threshold")  # request fields only Choral reads; not forwarded
# OpenAI fields Choral's own engine refuses (openai_api.NOT_IMPLEMENTED) that vLLM implements: forwarded.
# (logprobs, top_logprobs, logit_bias, the penalties, min_p and repetition_penalty both implement:
# checked by the same request models, then forwarded as sent; vLLM's answer carries its logprobs.)
VLLM_IMPLEMENTS = frozenset({"response_format"})


def _holds_oversized(value) -> bool:
    if isinstance(value, OversizedInt):
        return True
    if isinstance(value, list):
        return any(_holds_oversized(v) for v in value)
    if isinstance(value, dict):
        return any(_holds_oversized(v) for v in value.values())
    return False


@dataclass
class Replica:
    url: str
    pool: PoolSettings
    index: int  # its place in the pool (reported instead of the URL, which is internal)
    up: bool = False
    checked: bool = False  # its model and speculative config were checked
    unusable: str | None = None  # why it is never used (serves another model or config)
    inflight: int = 0  # requests this front has on it now
    vllm_load: float = 0.0  # running + waiting, from its /metrics
    model_id: str = ""  # the id it lists in /v1/models: what requests to it name

    @property
    def load(self) -> float:
        return max(float(self.inflight), self.vllm_load)

    @property
    def saturated(self) -> bool:
        return self.load >= self.pool.max_inflight

    @property
    def usable(self) -> bool:
        return self.up and self.checked and self.unusable is None

    def name(self) -> str:
        return f"{self.pool.name}/{self.index}"

    def mark_down(self) -> None:
        """Down until a poll sees it answer; whatever answers then is checked again."""
        self.up, self.checked, self.unusable, self.model_id = False, False, None, ""


def pool_tokens(pool: PoolSettings, acceptance_rate: float, collected_k: int) -> float:
    """The tokens one step of the pool commits for a request: with the drafter's per-token
    acceptance at the pool's K (the router's rate was measured at ``collected_k`` drafts); 1 for
    the target alone."""
    if pool.drafter == NONE:
        return 1.0
    a = per_token_acceptance(torch.tensor([float(acceptance_rate)]), collected_k)
    return float(expected_tokens(a, torch.tensor(float(pool.k)))[0])


def lone_step_cost(pool: PoolSettings, default_cost: float | None = None) -> float:
    """One step of the pool for a lone request, in target-alone steps: its measured ``step_cost``,
    else ``default_cost`` (the router's costs for a draft model), else 1 + 0.02 K; 1 for ``none``."""
    if pool.drafter == NONE:
        return 1.0
    return pool.step_cost or default_cost or (1.0 + 0.02 * pool.k)


def pool_speedup(pool: PoolSettings, acceptance_rate: float, collected_k: int, default_cost: float | None = None) -> float:
    """A pool's predicted speedup over the target alone for a lone request: ``pool_tokens`` over
    ``lone_step_cost``."""
    return pool_tokens(pool, acceptance_rate, collected_k) / lone_step_cost(pool, default_cost)


def load_fleet_profile(fleet: FleetConfig) -> Profile | None:
    """The fleet's measured profile (None without one); every pool that drafts with a model must
    have its draft's cost in it. Problems raise ``ConfigError`` naming the file and the fix."""
    if not fleet.profile:
        return None
    if not Path(fleet.profile).is_file():
        raise ConfigError(f"fleet profile {fleet.profile} does not exist (the fleet file's profile key; a relative path is "
                          "read from the working directory): measure one with scripts/experiments/bench_vllm_fleet.py "
                          "profile, or remove profile from the fleet file")  # fmt: skip
    profile = load_profile(fleet.profile)
    if not profile.target.ms(1, 1) > 0:
        raise ConfigError(f"fleet profile {fleet.profile}: its target step costs {profile.target.ms(1, 1)} ms; a profile "
                          "needs a measured target cost (bench_vllm_fleet.py profile)")  # fmt: skip
    missing = [p.name for p in fleet.pools
               if p.method in ("draft_model", "eagle", "eagle3", "mtp") and p.drafter not in profile.drafts]  # fmt: skip
    if missing:
        raise ConfigError(f"fleet profile {fleet.profile}: pools {missing} draft with a model the profile has no cost for "
                          f"(it has {sorted(profile.drafts)}); profile those pools "
                          "(scripts/experiments/bench_vllm_fleet.py profile) or remove profile from the fleet file")  # fmt: skip
    return profile


@dataclass
class Route:
    """Where a request goes and why: the pools in rank order with their predicted speedups."""

    ranked: list[tuple[PoolSettings, float]]
    router_choice: str | None = None
    predicted_acceptance: dict[str, float] = field(default_factory=dict)
    forced: bool = False
    tokens: dict[str, float] = field(default_factory=dict)  # pool name -> tokens one of its steps commits
    at_load: list[tuple[PoolSettings, float]] | None = None  # the ranking at the replicas' load, when last picked


class FleetServer:
    """The ``Backend`` (``serving.server.app``) of backend=vllm (the counterpart of ``server.EngineServer``):
    the router, the replicas' state and the forwarding of each request."""

    profile: Profile | None = None  # the fleet's measured step costs (FleetConfig.profile)

    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.fleet = load_config(FleetConfig, cfg.fleet)
        self.metrics = ServerMetrics()
        self.router: Any = None
        self.replicas = [Replica(url.rstrip("/"), p, i) for p in self.fleet.pools for i, url in enumerate(p.replicas)]
        self.client: httpx.AsyncClient | None = None
        self.load_error: str | None = None
        self.loaded = False
        self.started = int(time.time())
        self._choosing = threading.Lock()  # the router's embedder, one prompt batch at a time
        self._poller: asyncio.Task | None = None
        self._on_error: Callable[[BaseException], None] | None = None
        self._accepted_models = self._model_ids(self.fleet.model)
        self.model_name = cfg.model_name or self.fleet.served_model_name or Path(self._accepted_models[-1]).name
        self.profile = load_fleet_profile(self.fleet)

    def _step_ms(self, pool: PoolSettings, rows: int) -> float:
        """The profile's time of one step of ``pool`` with ``rows`` rows: the drafter's measured
        ``step`` where the profile has one, else the target's verify and the draft's forwards (a
        model-free drafter without a profile entry counts as free and always proposing)."""
        draft = self.profile.drafts.get(pool.drafter) if pool.drafter != NONE else None
        if draft is None:
            return step_ms(self.profile.target, None, pool.k, rows)
        if draft.step is not None and draft.step_k == pool.k:  # the pool's own step, measured at several batch sizes
            return draft.step.ms(rows, rows)
        # The profile's traffic mix weighs each domain's rate (the front does not know the prompt's domain).
        domains = self.profile.domains
        rate = sum(d.weight * draft.propose_rate(name) for name, d in domains.items()) / sum(d.weight for d in domains.values())
        return step_ms(self.profile.target, draft.cost, pool.k, rows, rate)

    @staticmethod
    def _model_ids(ref: str) -> list[str]:
        """The ids a replica serving ``ref`` may list: the reference and, for a bundled name or a
        folder, the folder's absolute path (vLLM lists its --model argument)."""
        ids = [ref]
        try:
            resolved = resolve_model_ref(ref)
            ids += [resolved, str(Path(resolved).resolve())]
        except FileNotFoundError:
            pass
        return list(dict.fromkeys(ids))

    # ---- the Backend protocol (serving.server.app) --------------------------------------------------

    @property
    def ready(self) -> bool:
        return self.loaded and any(r.usable for r in self.replicas)

    @property
    def error(self) -> str | None:
        """Why the front cannot serve: loading failed, or no replica is usable (each one's reason)."""
        if self.load_error is not None or not self.loaded or self.ready:
            return self.load_error
        return "no vLLM replica is usable: " + "; ".join(
            f"replica {r.name()} ({r.url}) {r.unusable or 'is down'}" for r in self.replicas)

    def model_info(self) -> dict:
        return {"backend": "vllm", "pools": {
            p.name: {"drafter": p.drafter, "speculative_config": p.speculative_config,
                     "replicas_up": sum(r.usable for r in self.replicas if r.pool is p), "replicas": len(p.replicas)}
            for p in self.fleet.pools}}  # fmt: skip

    async def start(self, on_error: Callable[[BaseException], None] | None) -> None:
        """Load the router (a background thread) and start watching the replicas."""
        self._on_error = on_error
        f = self.fleet
        timeout = httpx.Timeout(self.cfg.request_timeout_s, connect=f.connect_timeout_s)
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self._poller = asyncio.create_task(self._watch())

    async def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        if self.client is not None:
            await self.client.aclose()

    async def unavailable(self) -> str | None:
        return self.error

    # ---- loading and watching ---------------------------------------------------------------------

    async def _watch(self) -> None:
        try:
            if self.cfg.router is not None:
                self.router = await asyncio.to_thread(Router.load, self.cfg.router, "cpu")
                missing = [p.name for p in self.fleet.pools if p.drafter not in set(self.router.draft_names) | {NONE}]
                if missing:
                    raise ValueError(f"pools {missing} name drafters the router {self.cfg.router} does not know "
                                     f"({', '.join(self.router.draft_names)})")  # fmt: skip
            await self._poll_all()
            self.loaded = True
            log.info("choral: fleet front ready to route: %s", ", ".join(
                f"{r.name()} {'up' if r.usable else r.unusable or 'down'}" for r in self.replicas))  # fmt: skip
        except Exception as e:
            self.load_error = f"{type(e).__name__}: {e}"
            log.error("choral: loading failed: %s", self.load_error)
            if self._on_error is not None:
                self._on_error(e)
            return
        while True:
            await asyncio.sleep(self.fleet.health_interval_s)
            await self._poll_all()

    async def _poll_all(self) -> None:
        await asyncio.gather(*(self._poll(r) for r in self.replicas))
        for r in self.replicas:
            self.metrics.replica_up.labels(r.pool.name, str(r.index)).set(1.0 if r.usable else 0.0)
            self.metrics.replica_load.labels(r.pool.name, str(r.index)).set(r.load)

    async def _poll(self, r: Replica) -> None:
        """One look at a replica: /health, /metrics (its queue), and once, /v1/models."""
        was_up = r.up
        try:
            health = await self.client.get(f"{r.url}/health", timeout=self.fleet.connect_timeout_s)
            r.up = health.status_code == 200
            if r.up:
                text = (await self.client.get(f"{r.url}/metrics", timeout=self.fleet.connect_timeout_s)).text
                families = {f.name: f for f in text_string_to_metric_families(text)}
                r.vllm_load = sum(s.value for n in (RUNNING, WAITING) if n in families for s in families[n].samples)
                if not r.checked:
                    await self._check(r, families)
        except (httpx.HTTPError, ValueError) as e:
            r.up = False
            if was_up or not r.checked:
                log.debug("replica %s (%s): %s", r.name(), r.url, e)
        if r.up != was_up:
            log.log(logging.INFO if r.up else logging.WARNING, "replica %s (%s) is %s", r.name(), r.url,
                    "up" if r.up else "down")  # fmt: skip
        if not r.up:
            r.mark_down()

    async def _check(self, r: Replica, families: dict) -> None:
        """The replica serves the fleet's model, and drafts exactly when its pool does."""
        models = (await self.client.get(f"{r.url}/v1/models", timeout=self.fleet.connect_timeout_s)).json()
        ids = [m.get("id") for m in models.get("data", [])]
        match = [i for i in ids if i in self._accepted_models]
        drafts = SPEC_DRAFTS.removesuffix("_total") in families or SPEC_DRAFTS in families
        if not match:
            r.unusable = (f"serves {ids}, not the fleet's model {self.fleet.model!r} (accepted ids: "
                          f"{self._accepted_models})")  # fmt: skip
        elif self.fleet.check_spec and drafts != (r.pool.speculative_config is not None):
            r.unusable = (f"{'drafts' if drafts else 'does not draft'} (vLLM's /metrics {'has' if drafts else 'lacks'} "
                          f"{SPEC_DRAFTS}) but pool {r.pool.name!r} has speculative_config="
                          f"{r.pool.speculative_config}; relaunch it with the pool's config (scripts/export_vllm.py --fleet)")  # fmt: skip
        else:
            r.model_id = match[0]
        r.checked = True
        if r.unusable:
            log.error("replica %s (%s) %s: it will not be used", r.name(), r.url, r.unusable)

    # ---- choosing ---------------------------------------------------------------------------------

    def _route(self, text: str, forced: str | None) -> Route:
        """The pools in the order to try them (runs in a worker thread: the router embeds the text)."""
        pools = list(self.fleet.pools)
        if forced is not None:
            return Route([(p, 1.0) for p in pools if forced in (p.drafter, p.name)], forced=True)
        if self.router is None:
            return Route([(p, 1.0) for p in pools])
        with self._choosing:
            choice = self.router.choose(text)
        collected_k = int(self.router.info.get("collected_k") or 4)
        scored, tokens = [], {}
        for p in pools:
            cost = self.router.costs.get(p.drafter)
            default = p.k * cost["draft_cost"] + cost["verify_cost"] if cost and p.method == "draft_model" else None
            tokens[p.name] = pool_tokens(p, choice.predicted_acceptance.get(p.drafter, 0.0), collected_k)
            scored.append((p, tokens[p.name] / lone_step_cost(p, default)))
        scored.sort(key=lambda ps: -ps[1])  # stable: the file's order breaks ties
        return Route(scored, choice.draft, choice.predicted_acceptance, tokens=tokens)

    def _at_load(self, route: Route, tried: set[str]) -> list[PoolSettings]:
        """The pools in the order to try them now. With a profile and the router's prediction, each
        pool is scored by what this request adds to its least-loaded usable replica's throughput:
        that replica's tokens per lone target-alone step with the request (its rows plus one, each
        gaining the router's expected tokens per step, over the profile's step time at those rows)
        less the same without it. A replica at the pool's max_inflight scores 0: past it, requests
        wait in vLLM's queue rather than join the batch. An idle pool scores its lone speed; a busy
        one also pays for slowing the rows it already runs, so an idle replica of a slower pool can
        add more to the fleet (the goodput view). The route records that ranking in ``at_load``; without a
        profile or a prediction, the route's own order."""
        if self.profile is None or route.forced or not route.tokens:
            return [p for p, _ in route.ranked]
        lone = self.profile.target.ms(1, 1)
        scored = []
        for p, _ in route.ranked:
            loads = [r.load for r in self.replicas if r.pool is p and r.usable and r.url not in tried]
            busy = int(round(min(loads, default=0.0)))
            if busy >= p.max_inflight:  # full: the request would wait in vLLM's queue, adding nothing now
                scored.append((p, 0.0))
                continue
            tokens = route.tokens.get(p.name, 1.0) * lone  # per row and step, in lone target steps
            gain = tokens * (busy + 1) / self._step_ms(p, busy + 1)
            if busy:
                gain -= tokens * busy / self._step_ms(p, busy)
            scored.append((p, gain))
        scored.sort(key=lambda ps: -ps[1])  # stable: the lone ranking breaks ties
        route.at_load = scored
        return [p for p, _ in scored]

    def _pick(self, route: Route, tried: set[str]) -> tuple[Replica | None, list[dict]]:
        """The least-loaded replica with room in the first ranked pool that has one, and the pools
        passed over. When every usable replica is at max_inflight, the least loaded of the
        first-ranked pool that is up takes the request anyway (vLLM queues it): saturation
        moves traffic down the ranking, it never refuses it. None only when every pool is down."""
        passed, busy = [], None
        for pool in self._at_load(route, tried):
            candidates = [r for r in self.replicas if r.pool is pool and r.usable and r.url not in tried]
            free = [r for r in candidates if not r.saturated]
            if free:
                return min(free, key=lambda r: r.load), passed
            if candidates and busy is None:
                busy = min(candidates, key=lambda r: r.load)
            passed.append({"pool": pool.name, "reason": "saturated" if candidates else "down"})
        if busy is not None:  # everything up is full: queue on the best-ranked pool's least-loaded replica
            above = next(i for i, p in enumerate(passed) if p["pool"] == busy.pool.name)
            return busy, passed[:above]  # the pools ranked above it: all down
        return None, passed

    # ---- generation -------------------------------------------------------------------------------

    async def generate(self, http: HTTPRequest, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        t0 = time.perf_counter()
        try:
            if not self.ready:
                self.metrics.requests.labels(endpoint, "503").inc()
                return not_ready(self.error)
            raw = await read_body(http, self.cfg.max_body_bytes, self.cfg.body_timeout_s)
            data = parse_json(raw)
            body = validate_request(data, ChatCompletionRequest if chat else CompletionRequest, implemented=VLLM_IMPLEMENTS)
            check_model(body.model, self.model_name)
            forced = requested_draft(http, body)
            if body.verification == "threshold":  # vLLM's replicas verify exactly: nothing lossy to forward to
                raise APIError(400, "verification='threshold' is not available with backend=vllm (its replicas verify "
                               "exactly); send verification='exact' or omit it", param="verification")  # fmt: skip
            names = {p.drafter for p in self.fleet.pools} | {p.name for p in self.fleet.pools}
            if forced is not None and forced not in names:
                raise APIError(400, f"unknown draft {forced!r}; choose a pool's drafter or name: {', '.join(sorted(names))}",
                               param="draft", code="unknown_draft")  # fmt: skip
            payload = {k: v for k, v in data.items() if k not in CHORAL_FIELDS}
            huge = next((k for k, v in payload.items() if _holds_oversized(v)), None)
            if huge is not None:  # an unknown key passes validate_request, but cannot be forwarded
                raise APIError(400, f"{huge} holds an integer of more digits than any field takes; send a smaller one",
                               param=huge)  # fmt: skip
            route = await asyncio.to_thread(self._route, self._route_text(body, chat), forced)
            return await self._send(http, endpoint, chat, body, payload, route, t0)
        except APIError as e:
            self.metrics.requests.labels(endpoint, str(e.status)).inc()
            return json_error(e)

    @staticmethod
    def _route_text(body: Any, chat: bool) -> str:
        """What the router reads: the last user message, or the prompt (token-id prompts: nothing)."""
        if chat:
            users = [m.text() for m in body.messages if m.role == "user"]
            return users[-1] if users else body.messages[-1].text()
        return body.prompt if isinstance(body.prompt, str) else ""

    async def _send(self, http: HTTPRequest, endpoint: str, chat: bool, body: Any, payload: dict, route: Route,
                    t0: float) -> Response:  # fmt: skip
        """Forward to the best replica; a refused connection moves on to the next one."""
        path = "/v1/chat/completions" if chat else "/v1/completions"
        tried: set[str] = set()
        passed_all: list[dict] = []
        while True:
            replica, passed = self._pick(route, tried)
            passed_all += [p for p in passed if p not in passed_all]
            if replica is None:
                for p in passed_all:
                    self.metrics.pool_fallbacks.labels(p["pool"], p["reason"]).inc()
                what = "the forced pool is" if route.forced else "every pool is"
                raise APIError(503, f"{what} down ({', '.join(p['pool'] for p in passed_all)}); retry later", code="no_replica")
            tried.add(replica.url)
            stream_usage = body.stream and not body.include_usage
            out = dict(payload, model=replica.model_id)
            if body.stream:  # usage is how tokens are counted; a client that did not ask for it never sees it
                out["stream_options"] = dict(payload.get("stream_options") or {}, include_usage=True)
            replica.inflight += 1
            try:
                request = self.client.build_request("POST", f"{replica.url}{path}", json=out)
                response = await self.client.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                replica.inflight -= 1
                replica.mark_down()
                log.warning("replica %s (%s) refused a request (%s): marked down, trying the next", replica.name(),
                            replica.url, type(e).__name__)  # fmt: skip
                passed_all.append({"pool": replica.pool.name, "reason": "down"})
                continue
            except httpx.TransportError as e:  # connected, then lost before the answer's headers: mid-request
                context = self._context(endpoint, chat, replica, route, passed_all, t0, stream_usage)
                status, code = _failure(e)
                error = context.fail(status, type(e).__name__, code)
                context.count(status)
                return JSONResponse(error.body(), status_code=status)
            except BaseException:
                replica.inflight -= 1
                raise
            context = self._context(endpoint, chat, replica, route, passed_all, t0, stream_usage)
            if response.status_code != 200:
                return await context.error_response(response)
            if body.stream:
                return StreamingResponse(context.relay(response), media_type="text/event-stream")
            return await context.collect(http, response)

    def _context(self, endpoint: str, chat: bool, replica: Replica, route: Route, passed: list[dict], t0: float,
                 hide_usage: bool) -> "_Forward":  # fmt: skip
        for p in passed:
            self.metrics.pool_fallbacks.labels(p["pool"], p["reason"]).inc()
        return _Forward(self, endpoint, chat, replica, route, passed, t0, new_id("chatcmpl" if chat else "cmpl"), hide_usage)


def _failure(e: Exception) -> tuple[int, str]:
    """The status and code of a request its replica did not finish: slow (504) or gone (502)."""
    return (504, "replica_timeout") if isinstance(e, httpx.TimeoutException) else (502, "replica_failed")


@dataclass
class _Forward:
    """One forwarded request: its replica, counting, and the ``choral`` object."""

    server: FleetServer
    endpoint: str
    chat: bool
    replica: Replica
    route: Route
    fallback: list[dict]
    t0: float
    id: str
    hide_usage: bool = False
    counted: bool = False

    def count(self, status: int, tokens: int = 0) -> None:
        if self.counted:
            return
        self.counted = True
        self.replica.inflight -= 1
        m, pool = self.server.metrics, self.replica.pool.name
        m.requests.labels(self.endpoint, str(status)).inc()
        m.pool_requests.labels(pool, str(status)).inc()
        if status == 200:
            m.pool_tokens.labels(pool).inc(tokens)
            m.e2e.observe(time.perf_counter() - self.t0)

    def choral(self) -> dict:
        r, route = self.replica, self.route
        return {
            "backend": "vllm",
            "pool": r.pool.name,
            "replica": r.index,
            "draft": r.pool.drafter,
            "num_speculative_tokens": r.pool.k,
            "forced": route.forced,
            "router_choice": route.router_choice,
            "predicted_acceptance": route.predicted_acceptance.get(r.pool.drafter),
            "predicted_speedup": {p.name: round(s, 4) for p, s in (route.at_load or route.ranked)},
            "fallback": self.fallback,
        }

    def fail(self, status: int, message: str, code: str) -> APIError:
        if status == 502:
            self.replica.mark_down()  # the next poll tells whether it is back
        log.warning("replica %s (%s) failed a request: %s", self.replica.name(), self.replica.url, message)
        if status == 504:  # alive but slow: not marked down
            timeout = self.server.cfg.request_timeout_s
            return APIError(504, f"the vLLM replica {self.replica.name()} sent nothing for request_timeout_s={timeout} s "
                            "(its queue is long); retry later, or raise request_timeout_s", code=code)  # fmt: skip
        return APIError(status, f"the vLLM replica {self.replica.name()} failed mid-request ({message}); retry",
                        code=code, type="server_error")  # fmt: skip

    async def error_response(self, response: httpx.Response) -> Response:
        """The replica's own error (its OpenAI error body), passed through with its status."""
        try:
            body = json.loads(await response.aread())
        except (ValueError, httpx.HTTPError):
            body = APIError(response.status_code, f"the vLLM replica {self.replica.name()} answered HTTP "
                            f"{response.status_code}").body()  # fmt: skip
        finally:
            await response.aclose()
        self.count(response.status_code)
        return JSONResponse(body, status_code=response.status_code)

    async def collect(self, http: HTTPRequest, response: httpx.Response) -> Response:
        read = asyncio.create_task(response.aread())
        gone = asyncio.create_task(wait_disconnect(http))
        try:
            done, _ = await asyncio.wait({read, gone}, return_when=asyncio.FIRST_COMPLETED)
            if read not in done:  # the client left: closing the response makes vLLM abort the request
                self.count(499)
                return Response(status_code=499)
            try:
                body = json.loads(read.result())
            except (httpx.TransportError, ValueError) as e:
                status, code = _failure(e)
                error = self.fail(status, type(e).__name__, code)
                self.count(status)
                return JSONResponse(error.body(), status_code=status)
        except asyncio.CancelledError:  # the handler was cancelled (shutdown, client gone)
            self.count(499)
            raise
        finally:
            read.cancel()
            gone.cancel()
            await response.aclose()
        body["model"] = self.server.model_name
        body["choral"] = self.choral()
        self.count(200, int((body.get("usage") or {}).get("completion_tokens") or 0))
        return JSONResponse(body)

    async def relay(self, response: httpx.Response) -> AsyncIterator[bytes]:
        """vLLM's server-sent events, with the front's model id, the ``choral`` object on the
        chunk that finishes, and an error event if the replica dies mid-stream."""
        tokens, first = 0, True
        try:
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    self.count(200, tokens)
                    yield sse("[DONE]")
                    return
                chunk = json.loads(data)
                if first:
                    self.server.metrics.ttft.observe(time.perf_counter() - self.t0)
                    first = False
                chunk["model"] = self.server.model_name
                if chunk.get("usage") and not chunk.get("choices"):
                    tokens = int(chunk["usage"].get("completion_tokens") or 0)
                    if self.hide_usage:
                        continue
                if any(c.get("finish_reason") for c in chunk.get("choices") or []):
                    chunk["choral"] = self.choral()
                yield sse(chunk)
            raise httpx.RemoteProtocolError("the stream ended without [DONE]")
        except (httpx.TransportError, ValueError) as e:
            status, code = _failure(e)
            error = self.fail(status, type(e).__name__, code)
            self.count(status)
            yield sse(error.body())
            yield sse("[DONE]")
        finally:
            await response.aclose()
            self.count(499)  # the client went away: no-op once counted
