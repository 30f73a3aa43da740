"""Discrete-event model (SimPy) of a speculative-decoding deployment, fed by a measured profile.

Entities and what each costs in events (the model has to run 10,000 clients x 10 minutes in a
couple of minutes, so nothing is simulated per token):

* **Client** (device classes: phone, laptop, server, ...): runs one session at a time; requests
  that arrive while it is busy wait on the client. No process of its own.
* **Session** (``distributed``): one SimPy process per request. The client prefills its draft
  while the prompt travels to the target, which prefills and returns the first token; then the
  loop ``draft K tokens -> send -> wait for the verify batch -> receive`` runs until the output
  length is reached. Downlink, drafting and uplink are one timeout per step (their sum); the
  accepted length of a step is drawn from the draft's per-position acceptance for the domain
  (one uniform number against the cumulative curve), plus the target's correction/bonus token.
* **Target** (``distributed``): one process per server that forms batches from its queue of
  prefill and verify rows: it waits ``window_ms`` for more rows unless the batch is full, takes at
  most ``max_batch``, and holds for the profile's cost of that batch (scaled by the server's
  ``speed``). One event per batch plus one per row.
* **Fused server** (``fused``): draft and target both on the server; one process per server runs
  continuous batching over its admitted sessions (``max_batch``), one iteration = the draft's K
  forwards plus one verification over all rows. As in ``SpeculativeEngine.step``, a new row is
  prefilled (its first token) at the start of an iteration and then drafts and verifies in that
  same iteration, so its first chunk reaches the client with the iteration's tokens (TTFT = wait +
  prefill + one step). One event per iteration; sessions have no process. Clients only send prompts and receive tokens.

Load balancing picks a target per session (sessions are sticky: the KV cache lives there):
``round_robin``, ``jsq`` (fewest active sessions), ``jsq2`` (the lesser of two picked at random),
``weighted`` (smooth weighted round robin by each server's batch capacity). K is ``fixed`` or
``adaptive`` (+2 after a fully accepted step, -1 otherwise, within ``[k_min, k_max]``). The draft is
fixed or chosen per domain by a router table (default: the draft with the best predicted tokens
per second from its acceptance and costs).

Randomness comes from one ``random.Random(seed)``; SimPy orders simultaneous events by insertion,
so a seed fixes the whole run.
"""

from __future__ import annotations

import bisect
import csv
import json
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import simpy
from simpy.events import Event, Timeout

from serving.config import ConfigError, to_dict
from serving.fleet.profile import CostModel, LengthDist, Link, Profile, doc, step_ms

NONE = "none"  # the target alone, as a drafter name: no draft forwards, one token per step
_FREE = CostModel(base_ms=0.0)


@dataclass
class DeviceClass:
    draft_speed: float = field(default=1.0, metadata=doc("draft forwards run this many times faster than on the profile's machine"))
    link: Link = field(default_factory=lambda: Link(latency_ms=20.0, bandwidth_mbps=50.0), metadata=doc("network to the targets"))

    def __post_init__(self) -> None:
        if self.draft_speed <= 0:
            raise ValueError(f"draft_speed={self.draft_speed} must be > 0")


@dataclass
class TargetGroup:
    count: int = field(default=1, metadata=doc("servers in this group"))
    speed: float = field(default=1.0, metadata=doc("forwards run this many times faster than on the profile's machine"))
    max_batch: int = field(default=32, metadata=doc("rows per forward at most"))
    window_ms: float = field(default=0.0, metadata=doc("distributed: when a row reaches an idle server, wait this long for more before a batch"))
    draft_speed: float | None = field(default=None, metadata=doc("fused: draft forwards this many times faster than on the profile's machine (null: speed)"))
    static_batch: bool = field(default=False, metadata=doc("every forward runs all max_batch rows (Choral's engine: static shapes); prefills run one by one"))
    step_overhead_ms: float = field(default=0.0, metadata=doc("fixed time added to every batch (scheduling, streaming, a draft node's round trip)"))
    pool: str | None = field(default=None, metadata=doc(
        "the one drafter these servers run, as a vLLM replica pool does ('none' or a draft of the profile); requests "
        "go to a server that runs their draft (the router's choice among the pools there are); null: any drafter per "
        "request (Choral's own engine)"))

    def __post_init__(self) -> None:
        if self.count < 1 or self.max_batch < 1:
            raise ValueError(f"count={self.count} and max_batch={self.max_batch} must be >= 1")
        if self.speed <= 0 or self.window_ms < 0 or self.step_overhead_ms < 0 or (self.draft_speed is not None and self.draft_speed <= 0):
            raise ValueError(f"speed={self.speed} and draft_speed={self.draft_speed} must be > 0, window_ms={self.window_ms} >= 0")


@dataclass
class Arrivals:
    kind: Literal["poisson", "bursty", "closed", "trace"] = field(
        default="poisson", metadata=doc("poisson; bursty (on/off); closed (each client thinks, asks, waits); trace (file)")
    )
    rate_per_client: float = field(default=0.01, metadata=doc("poisson/bursty: requests per second per client (long-run mean)"))
    on_s: float = field(default=10.0, metadata=doc("bursty: mean length of an on period (all requests arrive in on periods)"))
    off_s: float = field(default=20.0, metadata=doc("bursty: mean length of an off period"))
    think_time_s: float = field(default=60.0, metadata=doc("closed: mean think time between a response and the next request"))
    trace: str | None = field(default=None, metadata=doc("trace: JSONL or CSV with time_s [, client, domain, prompt_tokens, output_tokens]"))

    def __post_init__(self) -> None:
        if self.rate_per_client <= 0 or self.on_s <= 0 or self.off_s < 0 or self.think_time_s < 0:
            raise ValueError(
                f"rate_per_client={self.rate_per_client}, on_s={self.on_s} must be > 0; off_s={self.off_s}, think_time_s={self.think_time_s} >= 0"
            )
        if self.kind == "trace" and not self.trace:
            raise ValueError("trace is required when kind=trace (a JSONL or CSV file)")


@dataclass
class KPolicy:
    kind: Literal["fixed", "adaptive"] = field(default="fixed", metadata=doc("adaptive: +2 after a fully accepted step, else -1"))
    k: int = field(default=4, metadata=doc("draft tokens per step (adaptive: the starting K)"))
    k_min: int = 1
    k_max: int = 8

    def __post_init__(self) -> None:
        if not 1 <= self.k_min <= self.k <= self.k_max:
            raise ValueError(f"k={self.k}: need 1 <= k_min ({self.k_min}) <= k <= k_max ({self.k_max})")


@dataclass
class DraftChoice:
    policy: Literal["fixed", "router"] = field(default="fixed", metadata=doc("router: per-domain draft from `table` or the profile's predictions"))
    name: str | None = field(default=None, metadata=doc("fixed: draft name in the profile (null: its first draft)"))
    table: dict[str, str] = field(default_factory=dict, metadata=doc("router: domain -> draft; missing domains use the predicted best"))


@dataclass
class Workload:
    domains: dict[str, float] = field(default_factory=dict, metadata=doc("domain -> share; empty: the profile's mix"))
    prompt_tokens: LengthDist | None = field(default=None, metadata=doc("replaces every domain's prompt lengths"))
    output_tokens: LengthDist | None = field(default=None, metadata=doc("replaces every domain's output lengths"))


@dataclass
class Messages:
    request_bytes: int = field(default=200, metadata=doc("fixed bytes of a verify request (headers, ids)"))
    bytes_per_draft_token: int = field(default=8, metadata=doc("per draft token sent (id, and its probability for sampling)"))
    bytes_per_prompt_token: int = field(default=4, metadata=doc("per prompt token sent at the start"))
    response_bytes: int = field(default=100, metadata=doc("a verify answer or a streamed token chunk"))

    def __post_init__(self) -> None:
        if min(self.request_bytes, self.bytes_per_draft_token, self.bytes_per_prompt_token, self.response_bytes) < 0:
            raise ValueError("message sizes must be >= 0")


@dataclass
class SLO:
    ttft_ms: float = field(default=2000.0, metadata=doc("time to first token target"))
    tpot_ms: float = field(default=250.0, metadata=doc("time per output token target (after the first)"))


@dataclass
class Sweep:
    param: str | None = field(default=None, metadata=doc("dotted config key to sweep (`clients` = total clients, class mix kept)"))
    values: list[Any] = field(default_factory=list, metadata=doc("values of `param`, one run each"))
    compare: str | None = field(default="balancer", metadata=doc("second key: one line per value in the plot"))
    compare_values: list[Any] = field(default_factory=lambda: ["round_robin", "jsq2"])


@dataclass
class Output:
    dir: str = field(default="runs/simulate", metadata=doc("simulate.json, simulate.md and PNGs go here"))
    plots: bool = True


@dataclass
class SimulateConfig:
    profile: str | None = field(default=None, metadata=doc("profile file (spec-bench --profile, ...); e.g. the measured configs/profiles/cpu_bundled.yaml"))
    seed: int = 0
    duration_s: float = field(default=600.0, metadata=doc("simulated seconds"))
    warmup_s: float = field(default=60.0, metadata=doc("requests arriving earlier are not measured"))
    metrics_interval_s: float = field(default=5.0, metadata=doc("queue depth / utilisation sampling period"))
    architecture: Literal["distributed", "fused"] = field(default="distributed", metadata=doc("distributed: drafts on clients; fused: both on the server"))
    clients: dict[str, int] = field(default_factory=lambda: {"phone": 6000, "laptop": 3000, "server": 1000}, metadata=doc("device class -> clients"))
    devices: dict[str, DeviceClass] = field(
        default_factory=lambda: {
            "phone": DeviceClass(draft_speed=2.0, link=Link(latency_ms=40.0, bandwidth_mbps=20.0, jitter_ms=10.0)),
            "laptop": DeviceClass(draft_speed=4.0, link=Link(latency_ms=20.0, bandwidth_mbps=100.0, jitter_ms=5.0)),
            "server": DeviceClass(draft_speed=20.0, link=Link(latency_ms=1.0, bandwidth_mbps=10000.0)),
        },
        metadata=doc("device class -> draft speed and link"),
    )
    targets: list[TargetGroup] = field(default_factory=lambda: [TargetGroup(count=100, speed=20.0)], metadata=doc("target server groups"))
    target_cost: CostModel | None = field(
        default=None, metadata=doc("replaces the profile's target cost: hardware the profile did not measure (speed still applies)")
    )
    arrivals: Arrivals = field(default_factory=Arrivals)
    balancer: Literal["round_robin", "jsq", "jsq2", "weighted"] = field(default="jsq2", metadata=doc("how a session picks its target"))
    k: KPolicy = field(default_factory=KPolicy)
    draft: DraftChoice = field(default_factory=DraftChoice)
    workload: Workload = field(default_factory=Workload)
    messages: Messages = field(default_factory=Messages)
    slo: SLO = field(default_factory=SLO)
    sweep: Sweep = field(default_factory=Sweep)
    output: Output = field(default_factory=Output)

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"duration_s={self.duration_s}, warmup_s={self.warmup_s}: need 0 <= warmup_s < duration_s")
        if self.metrics_interval_s <= 0:
            raise ValueError(f"metrics_interval_s={self.metrics_interval_s} must be > 0")
        if not self.clients or any(n < 0 for n in self.clients.values()) or sum(self.clients.values()) < 1:
            raise ValueError(f"clients={self.clients} must map device classes to counts >= 0, at least one client")
        for name in self.clients:
            if name not in self.devices:
                raise ValueError(f"clients.{name}: no device class {name!r} under devices (known: {', '.join(self.devices)})")


class _Target:
    """One target server: queue, cost coefficients in seconds (speed applied), counters."""

    __slots__ = ("idx", "speed", "draft_speed", "max_batch", "window", "queue", "wake", "running", "sessions", "busy", "busy_until",
                 "batches", "rows", "c_base", "c_row", "c_tok", "c_pre", "capacity", "static", "overhead")  # fmt: skip

    def __init__(self, idx: int, group: TargetGroup, profile: Profile, k: int):
        self.idx, self.speed, self.max_batch, self.window = idx, group.speed, group.max_batch, group.window_ms / 1e3
        self.draft_speed = group.draft_speed or group.speed
        self.static, self.overhead = group.static_batch, group.step_overhead_ms / 1e3
        self.queue: deque = deque()
        self.wake = None
        self.running = False
        self.sessions = 0
        self.busy = self.busy_until = 0.0
        self.batches = self.rows = 0
        t, s = profile.target, 1e3 * group.speed
        self.c_base, self.c_row, self.c_tok, self.c_pre = t.base_ms / s, t.per_row_ms / s, t.per_token_ms / s, t.prefill_per_token_ms / s
        # Verify rows per second with full batches: the weight of `weighted` balancing.
        self.capacity = group.max_batch / (self.c_base + group.max_batch * (self.c_row + self.c_tok * (k + 1)))


class _Fused:
    """A session inside a fused server's batch (no process of its own)."""

    __slots__ = ("client", "req", "k", "committed", "new", "draft", "negc", "propose", "kk", "sent", "down", "ttft")


@dataclass
class _Request:
    arrival: float  # when the user asked
    domain: int
    prompt: int
    output: int
    sent: float = 0.0  # when the client began it (later than arrival while the client was busy)


class Simulation:
    """Build with a config and a profile, then :meth:`run` for the results dict."""

    def __init__(self, cfg: SimulateConfig, profile: Profile):
        if cfg.target_cost is not None:
            profile = replace(profile, target=cfg.target_cost)
        self.cfg, self.profile = cfg, profile
        self.rng = random.Random(cfg.seed)
        self.env = simpy.Environment()
        self._check()
        self.k_top = max(cfg.k.k, cfg.k.k_max if cfg.k.kind == "adaptive" else cfg.k.k)
        self._setup_workload()
        self.targets = [_Target(i, g, profile, cfg.k.k) for i, g in enumerate(g for g in cfg.targets for _ in range(g.count))]
        self._setup_drafts()
        self._setup_clients()
        self._rr: dict[int, int] = {}  # per server list: its round-robin position
        self._wrr = [0.0] * len(self.targets)
        # Measurements.
        self.records: list[tuple] = []  # (arrival, ttft, e2e, tokens, class, domain, target, draft, client wait); latencies from `sent`
        self.window_tokens = 0
        self.verify_calls = self.verify_tokens = self.drafted = self.accepted = 0
        self.series: dict[str, list[float]] = {k: [] for k in ("t", "queue_total", "queue_max", "util_mean", "util_max", "active_sessions", "tokens_per_s")}
        self._last_busy = [0.0] * len(self.targets)
        self._last_tokens = 0
        self.total_tokens = 0
        self.arrived = 0

    # -- setup -------------------------------------------------------------------------------

    def _check(self) -> None:
        cfg, p = self.cfg, self.profile
        if cfg.draft.policy == "fixed" and cfg.draft.name not in (None, NONE) and cfg.draft.name not in p.drafts:
            raise ConfigError(f"draft.name={cfg.draft.name!r} is not a draft of the profile (it has: {', '.join(p.drafts)})")
        for g in cfg.targets:
            if g.pool is not None and g.pool != NONE and g.pool not in p.drafts:
                raise ConfigError(f"targets[].pool={g.pool!r} is neither 'none' nor a draft of the profile (it has: {', '.join(p.drafts)})")
        for domain, name in cfg.draft.table.items():
            if name not in p.drafts and name != NONE:
                raise ConfigError(f"draft.table.{domain}={name!r} is not a draft of the profile (it has: {', '.join(p.drafts)})")
        for domain, w in cfg.workload.domains.items():
            if w < 0:
                raise ConfigError(f"workload.domains.{domain}={w} must be >= 0")
            if domain not in p.domains and (cfg.workload.prompt_tokens is None or cfg.workload.output_tokens is None):
                raise ConfigError(
                    f"workload.domains.{domain}: the profile has no lengths for it (it has: {', '.join(p.domains)}); "
                    "set workload.prompt_tokens and workload.output_tokens"
                )
        if cfg.workload.domains and sum(cfg.workload.domains.values()) <= 0:
            raise ConfigError(f"workload.domains={cfg.workload.domains} needs a weight > 0")
        if cfg.arrivals.kind == "trace" and not Path(cfg.arrivals.trace).exists():
            raise ConfigError(f"arrivals.trace={cfg.arrivals.trace!r} does not exist")

    def _setup_workload(self) -> None:
        cfg, p, rng = self.cfg, self.profile, self.rng
        mix = cfg.workload.domains or {d: dp.weight for d, dp in p.domains.items()}
        self.domains = [d for d, w in mix.items() if w > 0]
        total = sum(mix[d] for d in self.domains)
        self._dom_cum = list(np.cumsum([mix[d] / total for d in self.domains]))
        self._dom_cum[-1] = 1.0
        self._prompt_len, self._output_len = [], []
        for d in self.domains:
            dp = p.domains.get(d)
            self._prompt_len.append((cfg.workload.prompt_tokens or dp.prompt_tokens).sampler(rng))
            self._output_len.append((cfg.workload.output_tokens or dp.output_tokens).sampler(rng))

    def _setup_drafts(self) -> None:
        """Per (draft, domain): the acceptance curve as negated, non-decreasing values, so the
        accepted length of a step is ``bisect_left(negc, -u)`` for one uniform ``u``."""
        p, cfg = self.profile, self.cfg
        self.draft_names = list(p.drafts)
        # "none", the target alone, is a drafter too where a pool or the config names it: K = 0, no cost.
        uses_none = NONE in {g.pool for g in cfg.targets} | set(cfg.draft.table.values()) | {cfg.draft.name}
        self.none = len(self.draft_names) if uses_none and NONE not in p.drafts else None
        self.draft_names += [NONE] if self.none is not None else []
        self.dcost = [(p.drafts[n].cost, p.drafts[n].cost.prefill_per_token_ms) if n in p.drafts else (_FREE, 0.0)
                      for n in self.draft_names]  # fmt: skip
        # negc: the curve given a proposal (the profile's counts every step, so divided by the
        # fraction of steps that propose; a step that proposes nothing verifies one token).
        self.negc: dict[tuple[int, int], list[float]] = {}
        self.propose: dict[tuple[int, int], float] = {}
        for i, name in enumerate(self.draft_names):
            for j, d in enumerate(self.domains):
                rate = p.drafts[name].propose_rate(d) if i != self.none else 1.0
                curve = _extend(p.drafts[name].curve(d), self.k_top) if i != self.none else [0.0] * self.k_top
                self.negc[i, j] = [-min(1.0, c / rate) if rate > 0 else 0.0 for c in curve]
                self.propose[i, j] = rate
        if cfg.draft.policy == "fixed":
            fixed = self.draft_names.index(cfg.draft.name) if cfg.draft.name else 0
            self.draft_of_domain = [fixed] * len(self.domains)
        else:
            self.draft_of_domain = [
                self.draft_names.index(cfg.draft.table[d]) if d in cfg.draft.table else self._predicted_best(j)
                for j, d in enumerate(self.domains)
            ]
        # Draft forward cost in seconds for one row on the profile's machine (device speed applies).
        self.draft_step_s = [c.ms(1, 1) / 1e3 if i != self.none else 0.0 for i, (c, _) in enumerate(self.dcost)]
        self.draft_prefill_s = [pre / 1e3 for _, pre in self.dcost]
        self._setup_pools()

    def _setup_pools(self) -> None:
        """Which servers can take a request of each draft: with pools, those of the draft's pool
        (a domain whose chosen draft has no pool goes to the best predicted pool there is)."""
        groups = [g for g in self.cfg.targets for _ in range(g.count)]
        pool_of = [None if g.pool is None else self.draft_names.index(g.pool) for g in groups]
        served = {d for d in pool_of if d is not None}
        if None not in pool_of:
            self.draft_of_domain = [d if d in served else self._predicted_best(j, served)
                                    for j, d in enumerate(self.draft_of_domain)]  # fmt: skip
        self.servers_of = {d: [i for i, q in enumerate(pool_of) if q in (None, d)] for d in set(self.draft_of_domain)}

    def _k(self, draft: int) -> int:
        return 0 if draft == self.none else self.cfg.k.k

    def _predicted_best(self, j: int, among: set[int] | None = None) -> int:
        """The router's pick: highest expected tokens per second of a lone step, from the
        predicted acceptance (the profile's curve) and the measured costs (``none``: one token
        per plain target step)."""

        def rate(i: int) -> float:
            tokens, ms = self.lone_step(i, j)
            return tokens / ms

        return max(sorted(among) if among is not None else range(len(self.draft_names)), key=rate)

    def lone_step(self, i: int, j: int, draft_speed: float = 1.0, rows: int = 1) -> tuple[float, float]:
        """(expected tokens, ms) per row of one step of drafter ``i`` on domain ``j`` when ``rows``
        rows of it run together (1: alone), as the fused server charges it: K draft forwards over the
        rows (``draft_speed`` times faster than measured) when any row proposes, and a verify of K + 1
        tokens for a row that proposes, one plain token for a row that does not; the batch's time
        shared over its rows."""
        t, k, rate = self.profile.target, self._k(i), self.propose[i, j]
        tokens = 1 + rate * sum(-c for c in self.negc[i, j][:k])
        return tokens, step_ms(t, self.dcost[i][0], k, rows, rate, draft_speed) / rows

    def _setup_clients(self) -> None:
        cfg = self.cfg
        self.classes = [c for c, n in cfg.clients.items() if n > 0]
        counts = [cfg.clients[c] for c in self.classes]
        self.n_clients = sum(counts)
        self.client_class = np.repeat(np.arange(len(self.classes)), counts).tolist()
        self.busy = bytearray(self.n_clients)
        self.pending: dict[int, deque] = {}
        m = cfg.messages
        self.links = []
        for c in self.classes:
            dev = cfg.devices[c]
            ln = dev.link
            self.links.append((ln.latency_ms / 1e3, 8.0 / (ln.bandwidth_mbps * 1e6), ln.jitter_ms / 1e3, dev.draft_speed))
        self.msg = (m.request_bytes, m.bytes_per_draft_token, m.bytes_per_prompt_token, m.response_bytes)

    # -- running -----------------------------------------------------------------------------

    def run(self, progress: bool = False) -> dict:
        env, cfg = self.env, self.cfg
        for t in self.targets:
            if cfg.architecture == "fused":
                env.process(self._serve_fused(t))
        self._start_arrivals()
        env.process(self._monitor())
        start, cpu = time.perf_counter(), time.process_time()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=round(cfg.duration_s), desc="simulate", unit="sim s")
        chunk = max(1.0, cfg.duration_s / 100)
        now = 0.0
        while now < cfg.duration_s:
            now = min(cfg.duration_s, now + chunk)
            env.run(until=now)
            if bar is not None:
                bar.update(round(now) - bar.n)
        if bar is not None:
            bar.close()
        return self._results(time.perf_counter() - start, time.process_time() - cpu)

    def _transfer(self, cls: int, nbytes: int) -> float:
        lat, per_byte, jitter, _ = self.links[cls]
        return lat + nbytes * per_byte + (self.rng.expovariate(1.0 / jitter) if jitter else 0.0)

    def _new_request(self) -> _Request:
        j = bisect.bisect_left(self._dom_cum, self.rng.random())
        return _Request(self.env.now, j, self._prompt_len[j](), max(1, self._output_len[j]()))

    def _arrive(self, client: int, req: _Request | None = None) -> None:
        req = req or self._new_request()
        self.arrived += 1
        if self.busy[client]:
            self.pending.setdefault(client, deque()).append(req)
        else:
            self._start(client, req)

    def _start(self, client: int, req: _Request) -> None:
        self.busy[client] = 1
        req.sent = self.env.now
        t = self._pick_target(self.servers_of[self.draft_of_domain[req.domain]])
        t.sessions += 1
        if self.cfg.architecture == "fused":
            self._admit_fused(client, req, t)
        else:
            self._advance(t, self._session(client, req, t))

    def _finish(self, client: int, req: _Request, t: _Target, ttft: float, end: float, draft: int) -> None:
        """Record a finished request; the client is free once the last tokens reached it."""
        t.sessions -= 1
        self.records.append((req.arrival, ttft, end - req.sent, req.output, self.client_class[client], req.domain, t.idx, draft, req.sent - req.arrival))
        delay = max(0.0, end - self.env.now)
        self.env.timeout(delay).callbacks.append(lambda _e: self._release(client))

    def _release(self, client: int) -> None:
        queue = self.pending.get(client)
        if queue:
            self._start(client, queue.popleft())
            return
        self.busy[client] = 0
        if self.cfg.arrivals.kind == "closed":
            self._schedule_closed(client)

    def _pick_target(self, among: list[int]) -> _Target:
        """A server among ``among`` (indices: every server, or a pool's) by the balancer."""
        ts, policy = [self.targets[i] for i in among], self.cfg.balancer
        if policy == "round_robin":
            rr = self._rr[id(among)] = (self._rr.get(id(among), -1) + 1) % len(ts)
            return ts[rr]
        if policy == "jsq":
            return min(ts, key=lambda t: t.sessions)
        if policy == "jsq2":
            n = len(ts)
            a = int(self.rng.random() * n)
            b = int(self.rng.random() * (n - 1)) if n > 1 else 0
            b += b >= a  # a second, different server
            ta, tb = ts[a], ts[min(b, n - 1)]
            return ta if ta.sessions <= tb.sessions else tb
        # Smooth weighted round robin (nginx): deterministic, proportional to capacity, spread out.
        w = self._wrr
        total = sum(t.capacity for t in ts)
        for t in ts:
            w[t.idx] += t.capacity
        best = max(ts, key=lambda t: w[t.idx])
        w[best.idx] -= total
        return best

    # -- distributed: client sessions and verify servers --------------------------------------

    def _session(self, client: int, req: _Request, t: _Target):
        """One request of a client, as a generator: it yields ``(delay, step_tokens,
        prompt_tokens)`` for its next row (delay: seconds until the row reaches the target's
        queue) and is resumed when that row's batch is done. The target resumes it directly
        rather than through a SimPy event: one event per step (the row's travel) instead of
        three, which is what lets 10,000 clients run in minutes."""
        env, rng, cfg = self.env, self.rng, self.cfg
        cls = self.client_class[client]
        lat, per_byte, jitter, dspeed = self.links[cls]
        req_b, tok_b, prompt_b, resp_b = self.msg
        draft = self.draft_of_domain[req.domain]
        negc, propose = self.negc[draft, req.domain], self.propose[draft, req.domain]
        step_s = self.draft_step_s[draft] / dspeed
        adaptive, k, k_min, k_max = cfg.k.kind == "adaptive" and draft != self.none, self._k(draft), cfg.k.k_min, cfg.k.k_max
        warm, out = cfg.warmup_s, req.output
        down = lat + resp_b * per_byte

        # The draft prefills on the client while the prompt travels and the target prefills.
        draft_ready = env.now + self.draft_prefill_s[draft] * req.prompt / dspeed
        yield self._transfer(cls, req_b + prompt_b * req.prompt), 0, req.prompt
        arrive = env.now + down + (rng.expovariate(1.0 / jitter) if jitter else 0.0)  # first token at the client
        ttft = arrive - req.sent
        committed = 1
        self.total_tokens += 1
        if env.now >= warm:
            self.window_tokens += 1
        while committed < out:
            kk = min(k, out - committed - 1)  # never draft past the output length
            if propose < 1.0 and rng.random() >= propose:
                kk = 0  # nothing to propose: a plain one-token step
            up = lat + (req_b + tok_b * kk) * per_byte + (rng.expovariate(1.0 / jitter) if jitter else 0.0)
            # Receive the verdict, draft K tokens, send them: one delay.
            yield max(arrive, draft_ready) - env.now + kk * step_s + up, kk + 1, 0
            n = bisect.bisect_left(negc, -rng.random())  # accepted drafts: positions whose curve value > u
            if n > kk:
                n = kk
            new = min(n + 1, out - committed)  # + the target's correction or bonus token
            committed += new
            self.verify_calls += 1
            self.verify_tokens += n + 1
            self.drafted += kk
            self.accepted += n
            self.total_tokens += new
            if env.now >= warm:
                self.window_tokens += new
            if adaptive and (kk > 0 or propose == 1.0):  # a step without a proposal says nothing of K
                k = min(k + 2, k_max) if n == kk else max(k - 1, k_min)
            arrive = draft_ready = env.now + down + (rng.expovariate(1.0 / jitter) if jitter else 0.0)
        self._finish(client, req, t, ttft, arrive, draft)

    def _advance(self, t: _Target, session) -> None:
        """Run a session to its next row and send that row on its way to the target."""
        try:
            delay, step, prompt = next(session)
        except StopIteration:
            return
        Timeout(self.env, delay).callbacks.append(lambda _e: self._enqueue(t, (session, step, prompt)))

    def _enqueue(self, t: _Target, row: tuple) -> None:
        t.queue.append(row)
        if not t.running:
            # An idle target waits `window` for more rows; from then on batches follow each
            # other until the queue runs dry (rows that came during a batch have waited already).
            t.running = True
            if t.window > 0:
                Timeout(self.env, t.window).callbacks.append(lambda _e: self._run_batch(t))
            else:
                self._run_batch(t)

    def _run_batch(self, t: _Target) -> None:
        q = t.queue
        n = min(len(q), t.max_batch)
        batch = [q.popleft() for _ in range(n)]
        step = pre = widest = prefills = 0
        for _, s, p in batch:
            step += s
            pre += p
            widest = max(widest, s)
            prefills += p > 0
        cost = self._forward_s(t, n - prefills, step, widest, prefills, pre)
        t.busy += cost
        t.busy_until = self.env.now + cost
        t.batches += 1
        t.rows += n
        Timeout(self.env, cost).callbacks.append(lambda _e: self._batch_done(t, batch))

    @staticmethod
    def _forward_s(t: _Target, verifying: int, step: int, widest: int, prefills: int, pre: int) -> float:
        """Seconds of one target batch: ``verifying`` rows verify ``step`` tokens in all
        (``widest`` the most per row) and ``prefills`` rows prefill ``pre`` prompt tokens in all."""
        if not t.static:
            return t.overhead + t.c_base + t.c_row * (verifying + prefills) + t.c_tok * step + t.c_pre * pre
        # Static shapes: verification runs every slot at the widest width; each prefill is a
        # forward of its own.
        b = t.max_batch
        verify = t.c_base + t.c_row * b + t.c_tok * b * widest if verifying else 0.0
        return t.overhead + verify + prefills * (t.c_base + t.c_row) + t.c_pre * pre

    def _batch_done(self, t: _Target, batch: list) -> None:
        for session, _, _ in batch:
            self._advance(t, session)
        if t.queue:
            self._run_batch(t)
        else:
            t.running = False

    # -- fused: continuous batching on the server --------------------------------------------

    def _admit_fused(self, client: int, req: _Request, t: _Target) -> None:
        s = _Fused()
        cls = self.client_class[client]
        s.draft = self.draft_of_domain[req.domain]
        s.client, s.req, s.k, s.committed, s.new = client, req, self._k(s.draft), 0, True
        s.negc, s.propose = self.negc[s.draft, req.domain], self.propose[s.draft, req.domain]
        s.sent, s.ttft = req.sent, -1.0  # set when its first tokens go out
        lat, per_byte, jitter, _ = self.links[cls]
        s.down = (lat, self.msg[3] * per_byte, jitter)
        up = self._transfer(cls, self.msg[0] + self.msg[2] * req.prompt)
        self.env.timeout(up).callbacks.append(lambda _e: self._join_fused(t, s))

    def _join_fused(self, t: _Target, s: _Fused) -> None:
        t.queue.append(s)
        if t.wake is not None:
            t.wake.succeed()
            t.wake = None

    def _serve_fused(self, t: _Target):
        env, rng, cfg = self.env, self.rng, self.cfg
        p = self.profile
        q = t.queue
        active: list[_Fused] = []
        adaptive, k_min, k_max = cfg.k.kind == "adaptive", cfg.k.k_min, cfg.k.k_max
        dcost = self.dcost
        while True:
            while q and len(active) < t.max_batch:
                active.append(q.popleft())
            if not active:
                t.wake = env.event()
                yield t.wake
                continue
            step = pre = widest = prefills = 0
            per_draft: dict[int, list[int]] = {}  # draft -> [decoding rows, their largest K, new prompt tokens]
            for s in active:
                acc = per_draft.setdefault(s.draft, [0, 0, 0])
                if s.new:  # prefill gives the first token; the row decodes in this iteration too
                    s.new = False
                    s.committed = 1
                    pre += s.req.prompt
                    prefills += 1
                    acc[2] += s.req.prompt
                if s.committed < s.req.output:
                    kk = min(s.k, s.req.output - s.committed - 1)
                    if s.propose < 1.0 and rng.random() >= s.propose:
                        kk = 0  # nothing to propose: a plain one-token step
                    s.kk = kk
                    step += kk + 1
                    widest = max(widest, kk + 1)
                    acc[0] += 1
                    acc[1] = max(acc[1], kk)
            cost_s = self._forward_s(t, sum(acc[0] for acc in per_draft.values()), step, widest, prefills, pre)
            for d, (rows, kk, prompt) in per_draft.items():
                cost, pre_ms = dcost[d]
                # The batch's K sequential draft forwards over the decoding rows (rows with a
                # smaller K idle through the extra ones), and the new rows' draft prefill.
                r = t.max_batch if t.static else rows
                cost_s += ((kk * cost.ms(r, r) if rows else 0.0) + prompt * pre_ms) / (1e3 * t.draft_speed)
            n = len(active)
            t.busy += cost_s
            t.busy_until = env.now + cost_s
            t.batches += 1
            t.rows += n
            yield env.timeout(cost_s)
            now = env.now
            warm = now >= cfg.warmup_s
            keep = []
            for s in active:
                lat, per, jitter = s.down
                arrive = now + lat + per + (rng.expovariate(1.0 / jitter) if jitter else 0.0)
                new = 0
                if s.ttft < 0:  # the prefill's token goes out with this iteration's
                    s.ttft = arrive - s.sent
                    new = 1
                if s.committed < s.req.output:
                    kk = s.kk
                    a = bisect.bisect_left(s.negc, -rng.random())
                    if a > kk:
                        a = kk
                    gained = min(a + 1, s.req.output - s.committed)
                    s.committed += gained
                    new += gained
                    self.verify_calls += 1
                    self.verify_tokens += a + 1
                    self.drafted += kk
                    self.accepted += a
                    if adaptive and s.draft != self.none and (kk > 0 or s.propose == 1.0):
                        s.k = min(s.k + 2, k_max) if a == kk else max(s.k - 1, k_min)
                self.total_tokens += new
                if warm:
                    self.window_tokens += new
                if s.committed >= s.req.output:
                    self._finish(s.client, s.req, t, s.ttft, arrive, s.draft)
                else:
                    keep.append(s)
            active = keep

    # -- arrivals ----------------------------------------------------------------------------

    def _start_arrivals(self) -> None:
        a = self.cfg.arrivals
        if a.kind == "poisson":
            self.env.process(self._poisson())
        elif a.kind == "bursty":
            self.env.process(self._bursty())
        elif a.kind == "closed":
            for c in range(self.n_clients):
                self._schedule_closed(c)
        else:
            self.env.process(self._trace())

    def _poisson(self):
        rate, n = self.cfg.arrivals.rate_per_client * self.n_clients, self.n_clients
        while True:
            yield self.env.timeout(self.rng.expovariate(rate))
            self._arrive(int(self.rng.random() * n))

    def _bursty(self):
        """On/off modulated Poisson: on periods carry the whole long-run rate."""
        a, env, rng, n = self.cfg.arrivals, self.env, self.rng, self.n_clients
        rate_on = a.rate_per_client * n * (a.on_s + a.off_s) / a.on_s
        while True:
            end = env.now + rng.expovariate(1.0 / a.on_s)
            while True:
                gap = rng.expovariate(rate_on)
                if env.now + gap > end:
                    break
                yield env.timeout(gap)
                self._arrive(int(rng.random() * n))
            yield env.timeout(end - env.now + (rng.expovariate(1.0 / a.off_s) if a.off_s else 0.0))

    def _schedule_closed(self, client: int) -> None:
        think = self.cfg.arrivals.think_time_s
        delay = self.rng.expovariate(1.0 / think) if think > 0 else 0.0
        self.env.timeout(delay).callbacks.append(lambda _e: self._arrive(client))

    def _trace(self):
        env, rng = self.env, self.rng
        for row in read_trace(self.cfg.arrivals.trace):
            if row["time_s"] > env.now:
                yield env.timeout(row["time_s"] - env.now)
            client = int(row["client"]) % self.n_clients if row.get("client") is not None else int(rng.random() * self.n_clients)
            req = self._new_request()
            if row.get("domain") in self.domains:
                req.domain = self.domains.index(row["domain"])
            if row.get("prompt_tokens"):
                req.prompt = int(row["prompt_tokens"])
            if row.get("output_tokens"):
                req.output = max(1, int(row["output_tokens"]))
            self._arrive(client, req)

    # -- measurement -------------------------------------------------------------------------

    def _monitor(self):
        env, dt = self.env, self.cfg.metrics_interval_s
        while True:
            yield env.timeout(dt)
            now = env.now
            utils, depths = [], []
            for i, t in enumerate(self.targets):
                done = t.busy - max(0.0, t.busy_until - now)  # busy time up to now
                utils.append(min(1.0, (done - self._last_busy[i]) / dt))
                self._last_busy[i] = done
                depths.append(len(t.queue))
            s = self.series
            s["t"].append(now)
            s["queue_total"].append(sum(depths))
            s["queue_max"].append(max(depths))
            s["util_mean"].append(sum(utils) / len(utils))
            s["util_max"].append(max(utils))
            s["active_sessions"].append(sum(t.sessions for t in self.targets))
            s["tokens_per_s"].append((self.total_tokens - self._last_tokens) / dt)
            self._last_tokens = self.total_tokens

    def _results(self, wall_s: float, cpu_s: float) -> dict:
        cfg = self.cfg
        window = cfg.duration_s - cfg.warmup_s
        rec = [r for r in self.records if r[0] >= cfg.warmup_s]
        ttft = np.array([r[1] for r in rec]) * 1e3
        e2e = np.array([r[2] for r in rec]) * 1e3
        out = np.array([r[3] for r in rec])
        multi = out > 1
        tpot = (e2e[multi] - ttft[multi]) / (out[multi] - 1)
        good = (ttft <= cfg.slo.ttft_ms) & np.where(multi, (e2e - ttft) / np.maximum(out - 1, 1) <= cfg.slo.tpot_ms, True)
        busy = [(t.busy - max(0.0, t.busy_until - cfg.duration_s)) / cfg.duration_s for t in self.targets]
        summary = {
            "requests_arrived": self.arrived,
            "requests_completed": len(rec),
            "requests_unfinished": sum(t.sessions for t in self.targets) + sum(len(q) for q in self.pending.values()),
            "throughput_tokens_per_s": self.window_tokens / window,
            "requests_per_s": len(rec) / window,
            "ttft_ms": _pcts(ttft),
            "tpot_ms": _pcts(tpot),
            "e2e_ms": _pcts(e2e),
            "client_wait_ms": _pcts(np.array([r[8] for r in rec]) * 1e3),
            "goodput_requests_per_s": float(good.sum()) / window,
            "goodput_fraction": float(good.mean()) if len(rec) else 0.0,
            "goodput_tokens_per_s": float(out[good].sum()) / window,
            "tokens_per_target_call": self.verify_tokens / self.verify_calls if self.verify_calls else 0.0,
            "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
            "verify_calls": self.verify_calls,
            "mean_batch_rows": sum(t.rows for t in self.targets) / max(1, sum(t.batches for t in self.targets)),
            "utilisation_mean": float(np.mean(busy)),
            "utilisation_max": float(np.max(busy)),
            "queue_depth_mean": float(np.mean(self.series["queue_total"])) / len(self.targets) if self.series["t"] else 0.0,
            "queue_depth_max": max(self.series["queue_max"], default=0),
            "wall_s": wall_s,
            "cpu_s": cpu_s,
            "sim_seconds_per_wall_second": cfg.duration_s / wall_s if wall_s else 0.0,
        }
        per_class = {}
        for ci, name in enumerate(self.classes):
            sel = np.array([r[4] == ci for r in rec], dtype=bool)
            if sel.any():
                m = sel & multi
                per_class[name] = {
                    "requests": int(sel.sum()),
                    "ttft_ms": _pcts(ttft[sel]),
                    "tpot_ms": _pcts((e2e[m] - ttft[m]) / (out[m] - 1)),
                    "goodput_fraction": float(good[sel].mean()),
                }
        return {
            "summary": summary,
            "per_class": per_class,
            "per_domain_draft": {d: self.draft_names[self.draft_of_domain[j]] for j, d in enumerate(self.domains)},
            "per_target": {"utilisation": busy, "mean_batch_rows": [t.rows / max(1, t.batches) for t in self.targets]},
            "per_pool": self._per_pool(rec, busy),
            "timeseries": self.series,
            "config": to_dict(cfg),
            "profile": self.profile.meta,
        }

    def _per_pool(self, rec: list[tuple], busy: list[float]) -> dict:
        """Per server group's pool ('any' where servers run every drafter): servers, requests
        by domain, tokens and mean utilisation over the measured window."""
        pool_of = [g.pool or "any" for g in self.cfg.targets for _ in range(g.count)]
        out: dict[str, dict] = {}
        for name in dict.fromkeys(pool_of):
            idx = [i for i, q in enumerate(pool_of) if q == name]
            mine = [r for r in rec if pool_of[r[6]] == name]
            domains: dict[str, int] = {}
            for r in mine:
                domains[self.domains[r[5]]] = domains.get(self.domains[r[5]], 0) + 1
            out[name] = {"servers": len(idx), "requests": len(mine), "tokens": int(sum(r[3] for r in mine)),
                         "domains": domains, "utilisation_mean": float(np.mean([busy[i] for i in idx]))}  # fmt: skip
        return out


def simulate(cfg: SimulateConfig, profile: Profile, progress: bool = False) -> dict:
    return Simulation(cfg, profile).run(progress=progress)


def read_trace(path: str | Path) -> list[dict]:
    """Arrival rows sorted by ``time_s``: JSONL (one object a line) or CSV with a header."""
    path = Path(path)
    text = path.read_text()
    if path.suffix == ".csv":
        rows = [{k: (v if v != "" else None) for k, v in r.items()} for r in csv.DictReader(text.splitlines())]
    else:
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    for i, r in enumerate(rows):
        if r.get("time_s") is None:
            raise ConfigError(f"arrivals.trace={path}: row {i + 1} has no time_s")
        r["time_s"] = float(r["time_s"])
    return sorted(rows, key=lambda r: r["time_s"])


def _extend(curve: list[float], k: int) -> list[float]:
    """The curve up to position ``k``, non-increasing; past the measured positions each new one
    keeps the last measured conditional rate p[i]/p[i-1]."""
    c = [min(1.0, max(0.0, x)) for x in curve]
    for i in range(1, len(c)):
        c[i] = min(c[i], c[i - 1])
    ratio = c[-1] / c[-2] if len(c) > 1 and c[-2] > 0 else c[-1]
    while len(c) < k:
        c.append(c[-1] * ratio)
    return c[:k]


def _pcts(x: np.ndarray) -> dict:
    if len(x) == 0:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "mean": math.nan}
    p50, p90, p99 = np.percentile(x, [50, 90, 99])
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "mean": float(np.mean(x))}
