"""The server's configuration: one typed dataclass, loaded from YAML plus ``key=value`` overrides.

    cfg = load_config(ServeConfig, "configs/serve.yaml", ["port=8001", "max_batch_size=4"])

``describe(ServeConfig)`` (``serve --describe``) prints every key with its default and doc.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


def doc(text: str) -> dict:
    return {"doc": text}


@dataclass
class ServeConfig:
    role: Literal["fused", "target", "draft"] = field(default="fused", metadata=doc(
        "fused: router, drafts and target in one process; target: the gRPC verification service; "
        "draft: router, drafts and the HTTP API, verifying on a remote target"))
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
    device: Literal["auto", "cpu", "cuda", "neuron"] = field(default="auto", metadata=doc("where the models run"))
    dtype: Literal["float32", "bfloat16", "float16"] = field(default="float32", metadata=doc("weights' dtype"))
    max_batch_size: int = field(default=8, metadata=doc(
        "slots per engine (one engine per draft, all sharing the target): requests decoded together"))
    max_len: int | None = field(default=None, metadata=doc(
        "context per request (prompt + new tokens + K + 1); default min(2048, the target's)"))
    k: int | str = field(default=4, metadata=doc(
        "draft tokens per step for every engine, or 'auto' (adaptive); the router's suggested K per "
        "request is reported in the response, not applied"))
    draft_confidence: float | None = field(default=None, metadata=doc(
        "stop drafting once the draft's top probability drops below this (CPU)"))
    draft_stop: Literal["token", "cumulative"] = field(default="token", metadata=doc(
        "with draft_confidence: compare each draft token's top probability, or their running product "
        "(the block's chance of surviving whole)"))
    queue_limit: int = field(default=64, metadata=doc(
        "requests that may wait for a slot; beyond that new ones get HTTP 429"))
    request_timeout_s: float = field(default=300.0, metadata=doc(
        "a request unfinished after this many seconds is aborted (HTTP 504, or an error event)"))
    default_max_tokens: int = field(default=256, metadata=doc(
        "max_tokens when a request gives none (capped by what the context leaves)"))
    compile_backend: str | None = field(default=None, metadata=doc(
        "torch.compile backend for the step shapes (e.g. inductor); null = eager"))
    cpu_kernels: bool = field(default=True, metadata=doc(
        "on a CPU in fp32, Choral's batch-invariant kernels (eager only: off when compiling)"))
    draft_weights: Literal["auto", "fp32", "int8"] = field(default="auto", metadata=doc(
        "int8: drafts run as W8A8 int8 on the CPU kernels (~2.5x cheaper draft steps; the target stays "
        "fp32, so outputs are unchanged, only acceptance may move); auto: int8 wherever the CPU kernels run"))
    threads: int | None = field(default=None, metadata=doc(
        "torch intra-op threads of the serve process; null = torch's default (one per core). On a "
        "CPU shared with other busy processes, 1 avoids threads waiting on each other"))
    warmup: bool = field(default=True, metadata=doc(
        "run a short request through every engine before /health reports ready"))
    session_timeout_s: float = field(default=60.0, metadata=doc(
        "role=target: evict a session's KV cache after this long without a verify call"))
    batch_window_ms: float = field(default=2.0, metadata=doc(
        "role=target: how long to collect verify calls from many sessions into one batch"))
    log_level: Literal["critical", "error", "warning", "info", "debug"] = field(default="info", metadata=doc(
        "uvicorn's log level"))

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size={self.max_batch_size} must be >= 1")
        if self.queue_limit < 0:
            raise ValueError(f"queue_limit={self.queue_limit} must be >= 0")
        if self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s={self.request_timeout_s} must be > 0")
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} must be >= 1")
        if not (isinstance(self.k, int) or self.k == "auto"):
            raise ValueError(f"k={self.k!r} must be an integer or 'auto'")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads={self.threads} must be >= 1 (or null for torch's default)")
        if not 0 < self.port < 65536:
            raise ValueError(f"port={self.port} must be in 1..65535")
