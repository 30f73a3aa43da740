"""The fleet file: pools of vLLM replicas, one speculative configuration per pool.

    fleet = load_config(FleetConfig, "configs/fleet.yaml")

vLLM runs one speculative configuration per server, so a fleet gives each pool of replicas one
(``none``, ``ngram``, ``draft_model`` with a Choral-trained draft, ``eagle3`` where a head exists)
and ``serve --backend vllm --fleet fleet.yaml`` sends each request to the pool whose drafter the
router predicts fastest (``serving.server.vllm_backend``). ``scripts/export_vllm.py --fleet``
writes the launch command of every replica from the same file. Example (``configs/fleet.yaml``):

    model: qwen2.5-coder-1.5b-instruct          # the target every replica serves
    pools:
      - name: plain
        drafter: none                           # the router's name for this pool's drafter
        replicas: [http://127.0.0.1:8101]
      - name: draft-0.5b
        drafter: base
        speculative_config: {method: draft_model, model: qwen2.5-coder-0.5b-instruct, num_speculative_tokens: 4}
        replicas: [http://127.0.0.1:8102]
        step_cost: 1.35                          # measured: scripts/experiments/bench_vllm_fleet.py
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from serving.fleet.profile import doc

NONE = "none"
METHODS = ("ngram", "draft_model", "eagle", "eagle3", "suffix", "mtp")  # vLLM's speculative methods


@dataclass
class PoolSettings:
    """One pool: replicas that all run the same speculative configuration."""

    name: str = field(default="", metadata=doc("the pool's name (metrics label, the choral object's 'pool')"))
    drafter: str = field(default=NONE, metadata=doc(
        "the router's name for what this pool drafts with ('none' = the target alone); the router's "
        "predicted acceptance for it ranks the pool"))
    speculative_config: dict[str, Any] | None = field(default=None, metadata=doc(
        "vLLM's --speculative-config that every replica must run (method, num_speculative_tokens, "
        "model for draft_model); null = no speculation"))
    replicas: list[str] = field(default_factory=list, metadata=doc("base URLs of the pool's vLLM servers"))
    step_cost: float | None = field(default=None, metadata=doc(
        "one speculative step of this pool in target-alone steps (draft K tokens + verify K+1), "
        "measured through the vLLM backend; null: 1 + 0.02 K for model-free methods, the router's "
        "costs for a draft model"))
    max_inflight: int = field(default=8, metadata=doc(
        "requests a replica takes at once before it counts as saturated (the next-ranked pool gets the request)"))

    @property
    def k(self) -> int:
        spec = self.speculative_config or {}
        return int(spec.get("num_speculative_tokens", 0))

    @property
    def method(self) -> str:
        return (self.speculative_config or {}).get("method", NONE)

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("pools[].name is missing: give every pool a name")
        if not self.replicas:
            raise ValueError(f"pool {self.name!r} lists no replicas: add at least one base URL (http://HOST:PORT)")
        for url in self.replicas:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"pool {self.name!r}: replica {url!r} is not a base URL like http://127.0.0.1:8101")
        spec = self.speculative_config
        if (spec is None) != (self.drafter == NONE):
            raise ValueError(f"pool {self.name!r}: drafter={self.drafter!r} with speculative_config={spec}: a pool "
                             "drafts exactly when it has a speculative_config (drafter 'none' has none)")  # fmt: skip
        if spec is not None:
            if spec.get("method") not in METHODS:
                raise ValueError(f"pool {self.name!r}: speculative_config.method={spec.get('method')!r} must be one of "
                                 f"{', '.join(METHODS)}")  # fmt: skip
            k = spec.get("num_speculative_tokens")
            if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise ValueError(f"pool {self.name!r}: speculative_config.num_speculative_tokens={k!r} must be an integer >= 1")
            if spec["method"] in ("draft_model", "eagle", "eagle3") and not spec.get("model"):
                raise ValueError(f"pool {self.name!r}: method {spec['method']} needs speculative_config.model (the draft)")
        if self.step_cost is not None and not self.step_cost > 0:
            raise ValueError(f"pool {self.name!r}: step_cost={self.step_cost} must be > 0")
        if self.max_inflight < 1:
            raise ValueError(f"pool {self.name!r}: max_inflight={self.max_inflight} must be >= 1")


@dataclass
class FleetConfig:
    model: str = field(default="", metadata=doc(
        "the target every replica serves: the model id replicas list in /v1/models, or a bundled name or "
        "folder (its folder's path is what vLLM reports)"))
    served_model_name: str | None = field(default=None, metadata=doc(
        "the model id clients send to Choral's front; default: the target folder's name"))
    pools: list[PoolSettings] = field(default_factory=list, metadata=doc("the pools, each one speculative configuration"))
    health_interval_s: float = field(default=2.0, metadata=doc(
        "how often every replica's /health and /metrics are read (queue depth, up or down)"))
    connect_timeout_s: float = field(default=5.0, metadata=doc("connecting to a replica takes at most this long"))
    profile: str | None = field(default=None, metadata=doc(
        "a profile measured through these replicas (scripts/experiments/bench_vllm_fleet.py profile writes "
        "profile.sim.yaml; a relative path is read from the working directory): each request then ranks the "
        "pools by their step time at the load of each pool's least-loaded replica (a verify of K+1 tokens for 8 "
        "rows costs more next to a plain step than for one row); null: by each pool's lone step_cost"))
    check_spec: bool = field(default=True, metadata=doc(
        "at start, check that each replica runs its pool's speculative config (vLLM's /metrics reports "
        "speculative counters only when it drafts) and serves the model"))

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("model is missing: name the target every replica serves")
        if not self.pools:
            raise ValueError("pools is empty: list at least one pool of vLLM replicas")
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names repeat: {names}")
        urls = [u for p in self.pools for u in p.replicas]
        if len(set(urls)) != len(urls):
            raise ValueError(f"a replica is listed twice: {sorted(u for u in set(urls) if urls.count(u) > 1)}")
        if self.health_interval_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError(f"health_interval_s={self.health_interval_s} and connect_timeout_s={self.connect_timeout_s} "
                             "must be > 0")  # fmt: skip

    def pool(self, name: str) -> PoolSettings:
        return next(p for p in self.pools if p.name == name)
