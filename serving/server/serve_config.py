"""The server's configuration: one typed dataclass, loaded from YAML plus ``key=value`` overrides.

    cfg = load_config(ServeConfig, "configs/serve.yaml", ["port=8001", "engine.max_batch_size=4"])

``describe(ServeConfig)`` (``serve --describe``) prints every key with its default and doc. The
engines' settings are the ``engine`` section (``serving.engine.engine_settings.EngineSettings``, shared
with the other commands). ``routing`` says how the router's choices are applied: the drafter
and K per request for the batch the request joins, the mid-request fallback, and the log of
served requests that ``train-router`` can learn from.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from serving.distributed import SESSION_TIMEOUT_S
from serving.engine.engine_settings import EngineSettings

# Keys that moved into the shared engine section (serve's own names until the settings were unified).
_MOVED = ("device", "dtype", "max_batch_size", "max_len", "k", "draft_confidence", "draft_stop", "compile_backend",
          "cpu_kernels", "draft_weights", "threads")  # fmt: skip


def doc(text: str) -> dict:
    return {"doc": text}


@dataclass
class RoutingSettings:
    """How the router's choice is applied to each request (fused and draft roles)."""

    apply_k: bool = field(default=True, metadata=doc(
        "draft the router's K for each request (up to engine.request_k_max); false: every request drafts engine.k"))
    load_aware: bool = field(default=True, metadata=doc(
        "choose drafter and K for the batch occupancy at admission (a full batch makes verification and a draft "
        "model's work dearer; a seeded sampled request is routed as if alone, so that its draws never depend on "
        "the batch); false: as if each request ran alone"))
    fallback_ratio: float | None = field(default=0.75, metadata=doc(
        "switch a routed request to the target alone once its acceptance so far shows it (fallback_confidence) below "
        "the lower of its drafter's break-even acceptance and this fraction of the router's prediction; null: never"))
    fallback_after: int = field(default=16, metadata=doc("draft tokens a request drafts before the fallback judges it"))
    fallback_confidence: float = field(default=0.95, metadata=doc(
        "how sure the fallback must be that the acceptance is below the floor (the Clopper-Pearson upper bound "
        "from accepted / drafted so far): higher waits for more evidence"))
    explore: float = field(default=0.0, metadata=doc(
        "fraction of routed requests that draft with another of the router's drafters (never none), drawn "
        "uniformly (an epsilon-greedy contextual bandit): with log_requests, the log then measures every drafter "
        "on served traffic, not only the chosen one. Greedy output is unchanged (sampled output keeps its "
        "distribution), only speed; 0: always the router's choice"))
    explore_seed: int = field(default=0, metadata=doc("seed of the exploration draws (reproducible runs)"))
    log_requests: str | None = field(default=None, metadata=doc(
        "append each finished routed request as a row in collect-router-data's format to this .jsonl file "
        "(fsynced): train-router learns from it (data: [rows.jsonl, served.jsonl])"))

    def __post_init__(self) -> None:
        if self.fallback_ratio is not None and not 0.0 < self.fallback_ratio <= 1.0:
            raise ValueError(f"routing.fallback_ratio={self.fallback_ratio} must be in (0, 1] (or null: no fallback)")
        if not 0.0 <= self.explore < 1.0:
            raise ValueError(f"routing.explore={self.explore} must be in [0, 1): the fraction of routed requests "
                             "sent to another drafter (0: none)")
        if self.fallback_after < 1:
            raise ValueError(f"routing.fallback_after={self.fallback_after} must be >= 1")
        if not 0.5 <= self.fallback_confidence < 1.0:
            raise ValueError(f"routing.fallback_confidence={self.fallback_confidence} must be in [0.5, 1) (0.95: one "
                             "chance in 20 that a drafter paying its way is dropped)")
        if self.log_requests is not None and not self.log_requests.endswith(".jsonl"):
            raise ValueError(f"routing.log_requests={self.log_requests!r} must be a .jsonl file")


@dataclass
class GrpcSettings:
    """The distributed mode's link between draft nodes and the target (``--role target`` and
    ``--role draft``): a shared token, optional TLS and the deadline of each call."""

    token: str | None = field(default=None, metadata=doc(
        "shared secret: the target refuses calls without 'authorization: Bearer TOKEN' metadata and draft "
        "nodes send it; default: the CHORAL_GRPC_TOKEN environment variable, else none (loopback only)"))
    tls_cert: str | None = field(default=None, metadata=doc(
        "role=target: PEM certificate chain; with tls_key the target serves TLS only"))
    tls_key: str | None = field(default=None, metadata=doc("role=target: the PEM private key of tls_cert"))
    tls_ca: str | None = field(default=None, metadata=doc(
        "role=draft: PEM certificate(s) to trust for the target (its own certificate, or the CA that "
        "signed it); set, the draft node connects over TLS"))
    node_tokens: dict[str, str] | None = field(default=None, metadata=doc(
        "role=target: one token per draft node (name: token) instead of the shared token; each node sends its own "
        "as grpc.token, and the target tells nodes apart: a node holds at most max_sessions_per_node sessions"))
    max_sessions_per_node: int | None = field(default=None, metadata=doc(
        "role=target: the most sessions (target slots) one draft node may hold at once; default: the slots shared "
        "evenly among node_tokens' nodes (every slot with one shared token)"))
    deadline_s: float = field(default=30.0, metadata=doc(
        "role=draft: the deadline of every call to the target (a frozen target fails its requests after this)"))

    def resolved_token(self) -> str | None:
        return self.token or os.environ.get("CHORAL_GRPC_TOKEN") or None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(f"grpc.tls_cert={self.tls_cert} and grpc.tls_key={self.tls_key}: give both (TLS) or neither")
        if self.token is not None and self.node_tokens:
            raise ValueError("grpc.token and grpc.node_tokens: on the target give one shared token or per-node tokens, not both")
        if self.max_sessions_per_node is not None and self.max_sessions_per_node < 1:
            raise ValueError(f"grpc.max_sessions_per_node={self.max_sessions_per_node} must be >= 1 (or null)")
        if self.max_sessions_per_node is not None and not self.node_tokens:
            raise ValueError("grpc.max_sessions_per_node needs grpc.node_tokens: with one shared token every draft node is "
                             "the same caller, so the cap would limit the whole target")  # fmt: skip
        if self.node_tokens is not None:
            tokens = list(self.node_tokens.values())
            if not tokens or any(not t for t in tokens) or len(set(tokens)) != len(tokens):
                raise ValueError("grpc.node_tokens needs at least one node, each with its own non-empty token")
        if not self.deadline_s > 0:
            raise ValueError(f"grpc.deadline_s={self.deadline_s} must be > 0")

    def read(self, which: str) -> bytes:
        """The bytes of a PEM file setting, with an error that names it."""
        path = getattr(self, which)
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise ValueError(f"grpc.{which}={path}: cannot read it ({e.strerror})") from None


@dataclass
class ServeConfig:
    role: Literal["fused", "target", "draft"] = field(default="fused", metadata=doc(
        "fused: router, drafts and target in one process; target: the gRPC verification service; "
        "draft: router, drafts and the HTTP API, verifying on a remote target"))
    backend: Literal["choral", "vllm"] = field(default="choral", metadata=doc(
        "choral: Choral's own engine runs the target and the drafters; vllm: forward each request to a pool "
        "of vLLM replicas listed in the fleet file, the pool whose drafter the router ranks first"))
    fleet: str | None = field(default=None, metadata=doc(
        "backend=vllm: the fleet file (serving/fleet/fleet_file.py: pools, their speculative config, replica URLs)"))
    router: str | None = field(default=None, metadata=doc(
        "router.pt from train-router (fused and draft roles): names the target and the drafts"))
    target_model: str | None = field(default=None, metadata=doc(
        "target model reference; default: the router's target (role=target needs one of the two)"))
    target_address: str | None = field(default=None, metadata=doc(
        "role=draft: HOST:PORT of the `serve --role target` service"))
    host: str = field(default="127.0.0.1", metadata=doc("address to listen on (HTTP; gRPC for role=target)"))
    port: int = field(default=8000, metadata=doc("port to listen on (HTTP; gRPC for role=target)"))
    model_name: str | None = field(default=None, metadata=doc(
        "model id that clients send and /v1/models lists; default: the target reference"))
    queue_limit: int = field(default=64, metadata=doc(
        "requests that may wait for a slot; beyond that new ones get HTTP 429"))
    per_client_limit: int = field(default=32, metadata=doc(
        "requests one client may have running and waiting together; beyond that its new ones get HTTP 429 "
        "naming this limit. A client is its own API key, else its address; the next free slot goes to the "
        "client with the fewest running (serving/server/admission.py)"))
    idle_timeout_s: float = field(default=15.0, metadata=doc(
        "a connection that sends no request within this many seconds (after opening, or after its last "
        "answer) is closed"))
    max_connections: int = field(default=1024, metadata=doc(
        "open connections (and requests in flight) beyond which new requests get HTTP 503 (uvicorn's "
        "limit_concurrency)"))
    api_key: str | None = field(default=None, metadata=doc(
        "like vLLM's --api-key: every route but /health and /metrics needs 'Authorization: Bearer KEY' "
        "(the openai client's api_key); default: the CHORAL_API_KEY environment variable, else no key"))
    docs: bool = field(default=False, metadata=doc("serve FastAPI's interactive docs (/docs, /redoc, /openapi.json)"))
    max_body_bytes: int = field(default=2 * 1024 * 1024, metadata=doc(
        "largest request body accepted; a larger one gets HTTP 413 before it is parsed"))
    body_timeout_s: float = field(default=30.0, metadata=doc(
        "a request body still arriving after this many seconds is cut off (HTTP 408): a client that "
        "trickles its body cannot hold a connection open"))
    request_timeout_s: float = field(default=300.0, metadata=doc(
        "a request unfinished after this many seconds is aborted (HTTP 504, or an error event)"))
    default_max_tokens: int = field(default=256, metadata=doc(
        "max_tokens when a request gives none (capped by what the context leaves)"))
    warmup: bool = field(default=True, metadata=doc(
        "run a short request through every engine before /health reports ready"))
    session_timeout_s: float = field(default=SESSION_TIMEOUT_S, metadata=doc(
        "role=target: evict a session's KV cache after this long without a verify call"))
    batch_window_ms: float = field(default=2.0, metadata=doc(
        "role=target: how long to collect verify calls from many sessions into one batch"))
    verification: Literal["exact", "threshold"] = field(default="exact", metadata=doc(
        "how requests that name none are verified: exact (the target's own output) or threshold (lossy, faster; "
        "needs allow_lossy)"))
    verification_threshold: float = field(default=0.1, metadata=doc(
        "threshold verification: a draft token is accepted when the target's probability of it (temperature 1) is at "
        "least this; for requests that send no verification_threshold"))
    allow_lossy: bool = field(default=False, metadata=doc(
        "serve verification=threshold requests (output not the target's); false: they get a 400"))
    grpc: GrpcSettings = field(default_factory=GrpcSettings, metadata=doc("the distributed mode's gRPC link"))
    log_level: Literal["critical", "error", "warning", "info", "debug"] = field(default="info", metadata=doc(
        "uvicorn's log level"))
    routing: RoutingSettings = field(default_factory=RoutingSettings, metadata=doc(
        "how the router's choices apply: K, load, fallback, request log"))
    engine: EngineSettings = field(default_factory=lambda: EngineSettings(max_batch_size=8))

    RENAMED: ClassVar[dict[str, str]] = {name: f"engine.{name}" for name in _MOVED} | {"engine.batch_size": "engine.max_batch_size"}

    def resolved_api_key(self) -> str | None:
        """``api_key``, else CHORAL_API_KEY, else None (no key)."""
        return self.api_key or os.environ.get("CHORAL_API_KEY") or None

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes={self.max_body_bytes} must be >= 1024")
        if self.queue_limit < 0:
            raise ValueError(f"queue_limit={self.queue_limit} must be >= 0")
        if self.per_client_limit < 1:
            raise ValueError(f"per_client_limit={self.per_client_limit} must be >= 1 (requests a client may hold)")
        if self.idle_timeout_s <= 0:
            raise ValueError(f"idle_timeout_s={self.idle_timeout_s} must be > 0")
        if self.max_connections < 1:
            raise ValueError(f"max_connections={self.max_connections} must be >= 1")
        if self.body_timeout_s <= 0:
            raise ValueError(f"body_timeout_s={self.body_timeout_s} must be > 0")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s={self.request_timeout_s} must be > 0")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} must be >= 1")
        if self.backend == "vllm" and self.role != "fused":
            raise ValueError(f"backend=vllm with role={self.role}: the vLLM replicas are the targets; drop role")
        if self.backend == "vllm" and self.routing.log_requests is not None:
            raise ValueError("routing.log_requests logs Choral's own engine (backend=choral); vLLM pools keep their own logs")
        if self.backend == "vllm" and self.fleet is None:
            raise ValueError("backend=vllm needs a fleet file: pass --fleet fleet.yaml")
        if self.verification == "threshold" and not self.allow_lossy:
            raise ValueError("verification=threshold makes every request lossy by default; set allow_lossy=true to "
                             "mean it, or keep verification=exact")  # fmt: skip
        if not 0 < self.verification_threshold <= 1:
            raise ValueError(f"verification_threshold={self.verification_threshold} must be in (0, 1] (0.1 is the usual)")
        if not 0 < self.port < 65536:
            raise ValueError(f"port={self.port} must be in 1..65535")
