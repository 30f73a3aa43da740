"""Prometheus metrics of the server, in a registry of their own (``GET /metrics`` renders it).

Names follow Prometheus conventions (``_total`` counters, ``_seconds`` histograms). Acceptance
per draft is ``choral_accepted_tokens_total / choral_drafted_tokens_total`` over any window;
``choral_request_acceptance_rate`` is its per-request distribution.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Latency buckets from a fast CPU step (ms) to a long generation (minutes).
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_TOKEN_LATENCY = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_RATE = tuple(i / 10 for i in range(1, 11))


class ServerMetrics:
    """All metrics; thread-safe (prometheus_client locks), so the engine thread updates them."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("choral_requests", "HTTP generation requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)  # fmt: skip
        self.prompt_tokens = Counter("choral_prompt_tokens", "prompt tokens of admitted requests", registry=r)
        self.generated_tokens = Counter("choral_generated_tokens", "tokens generated, by draft", ["draft"], registry=r)
        self.drafted_tokens = Counter("choral_drafted_tokens", "draft tokens proposed, by draft", ["draft"], registry=r)
        self.accepted_tokens = Counter("choral_accepted_tokens", "draft tokens the target accepted, by draft",
                                       ["draft"], registry=r)  # fmt: skip
        self.target_calls = Counter("choral_target_calls", "verification steps (per request), by draft",
                                    ["draft"], registry=r)  # fmt: skip
        self.drafts = Counter("choral_spec_decode_drafts", "proposals verified (steps in which a request drafted), by drafter",
                              ["draft"], registry=r)  # fmt: skip
        self.capped_steps = Counter("choral_load_capped_steps", "steps of finished requests whose K the engine lowered "
                                    "for the batch's load (engine.step_k goodput: the K that maximises the batch's "
                                    "expected tokens per second), by draft", ["draft"], registry=r)  # fmt: skip
        self.drafter_steps = Counter("choral_drafter_steps", "steps of finished requests by the drafter whose proposal "
                                     "the step verified (none: nothing drafted); auto's requests spread over several, "
                                     "by the request's draft", ["draft", "drafter"], registry=r)  # fmt: skip
        self.draft_choices = Counter("choral_draft_choices", "requests per draft; forced = chosen by the client",
                                     ["draft", "forced"], registry=r)  # fmt: skip
        self.grammar_tokens = Counter("choral_grammar_forced_tokens", "answer tokens that were a JSON grammar's forced "
                                      "tokens, drafted for free and accepted (response_format, tools)", registry=r)  # fmt: skip
        self.processor_requests = Counter("choral_processor_requests", "admitted requests that use a logits processor, by "
                                          "processor (logit_bias, repetition_penalty, frequency_penalty, presence_penalty, "
                                          "min_p); a request using several counts under each", ["processor"], registry=r)  # fmt: skip
        self.verification = Counter("choral_verification_requests", "finished requests by how they were verified "
                                    "(exact: the target's own output; threshold: lossy, opt-in)", ["verification"],
                                    registry=r)  # fmt: skip
        self.finished = Counter("choral_finished_requests", "requests that ended, by how",
                                ["reason"], registry=r)  # fmt: skip
        self.engine_steps = Counter("choral_engine_steps", "speculative steps run (draft=engine: the one engine, which holds every drafter)", ["draft"], registry=r)
        self.queue_depth = Gauge("choral_queue_depth", "requests waiting for a slot", registry=r)
        self.running = Gauge("choral_running_requests", "requests holding a slot", registry=r)
        self.ttft = Histogram("choral_time_to_first_token_seconds", "request arrival to its first token",
                              buckets=_LATENCY, registry=r)  # fmt: skip
        self.itl = Histogram("choral_inter_token_latency_seconds",
                             "time between tokens of a request (a step's gap spread over the tokens it committed)",
                             buckets=_TOKEN_LATENCY, registry=r)  # fmt: skip
        self.e2e = Histogram("choral_e2e_latency_seconds", "request arrival to its last token",
                             buckets=_LATENCY, registry=r)  # fmt: skip
        self.step_time = Histogram("choral_engine_step_seconds", "one engine step (admissions + speculative step)",
                                   ["draft"], buckets=_TOKEN_LATENCY + (5.0, 10.0), registry=r)  # fmt: skip
        # backend=vllm: the pools of vLLM replicas (serving/server/vllm_backend.py).
        self.pool_requests = Counter("choral_pool_requests", "requests forwarded to a pool, by pool and status",
                                     ["pool", "status"], registry=r)  # fmt: skip
        self.pool_tokens = Counter("choral_pool_generated_tokens", "completion tokens a pool generated", ["pool"], registry=r)
        self.pool_fallbacks = Counter("choral_pool_fallbacks", "times a pool was passed over for a request it ranked "
                                      "above the one that took it, by reason (down, saturated)", ["pool", "reason"],
                                      registry=r)  # fmt: skip
        self.replica_up = Gauge("choral_replica_up", "1 while a replica answers /health and serves the fleet's config",
                                ["pool", "replica"], registry=r)  # fmt: skip
        self.replica_load = Gauge("choral_replica_load", "a replica's load: requests on it (this front's count or vLLM's "
                                  "running + waiting, whichever is larger)", ["pool", "replica"], registry=r)  # fmt: skip
        self.acceptance = Histogram("choral_request_acceptance_rate", "per-request acceptance rate, by draft",
                                    ["draft"], buckets=_RATE, registry=r)  # fmt: skip
        # The router's view against what served requests got: a drift alarm per drafter.
        self.predicted_acceptance = Histogram("choral_router_predicted_acceptance", "the router's predicted acceptance "
                                              "of routed requests that drafted, by draft (compare with "
                                              "choral_request_acceptance_rate)", ["draft"], buckets=_RATE, registry=r)  # fmt: skip
        self.acceptance_error = Gauge("choral_router_acceptance_error", "live minus predicted acceptance of routed "
                                      "requests, by draft: a moving average over the last ~20 requests; far from 0 "
                                      "means the traffic drifted from the router's training data", ["draft"], registry=r)  # fmt: skip
        self.fallbacks = Counter("choral_drafter_fallbacks", "requests switched to the target alone mid-request because "
                                 "their drafter's acceptance so far showed it below what pays, by the drafter they left",
                                 ["draft"], registry=r)  # fmt: skip
        self.chosen_k = Histogram("choral_chosen_k", "the K (num_speculative_tokens) routed requests drafted with, by draft",
                                  ["draft"], buckets=(1, 2, 3, 4, 5, 6, 7, 8, 12, 16), registry=r)  # fmt: skip
        self.explored = Counter("choral_router_explored", "routed requests sent to another drafter than the router's "
                                "choice (routing.explore), by the drafter the router chose", ["draft"], registry=r)  # fmt: skip
        self.logged_rows = Counter("choral_logged_requests", "served requests written to the request log (log_requests)",
                                   registry=r)  # fmt: skip

    def render(self) -> bytes:
        return generate_latest(self.registry)
