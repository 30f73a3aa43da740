"""serve: the OpenAI-compatible server with routed speculative decoding.

    serve --router runs/router/router.pt                              # fused: everything here
    serve --router router.pt --config configs/serve.yaml port=8001 engine.max_batch_size=4
    serve --role target --router router.pt port=50051                 # gRPC verification service
    serve --role draft --target 127.0.0.1:50051 --router router.pt    # HTTP API + drafts
    serve --backend vllm --fleet configs/fleet.yaml --router router.pt  # routes among vLLM replica pools
    serve --describe                                                  # every config key

Flags are shorthands for config keys (``--router X`` is ``router=X``, ``--target`` is
``target_address``); ``key=value`` overrides come last and win.

This module is the one place in the server layer that imports lazily: torch and what imports it
(the router, the models, the gRPC roles, the HTTP app and its backends) load inside the function
that needs them, so ``serve --describe`` prints the settings without loading torch.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from serving.cli import Command, Flag
from serving.config import ConfigError, load_config
from serving.fleet.fleet_file import FleetConfig
from serving.server.serve_config import ServeConfig

log = logging.getLogger(__name__)
LOOPBACK = ("127.0.0.1", "localhost", "::1")  # hosts only this machine reaches: no key or token needed

CLI = Command("serve", ServeConfig, __doc__, flags=[
    Flag("--router", "router"),
    Flag("--role", "role"),
    Flag("--target", "target_address", help="role=draft: HOST:PORT of the target service"),
    Flag("--host", "host"),
    Flag("--port", "port"),
    Flag("--api-key", "api_key"),
    Flag("--backend", "backend"),
    Flag("--fleet", "fleet", help="backend=vllm: the fleet file"),
], errors=(FileNotFoundError,))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return CLI.main(argv, run)


def run(cfg: ServeConfig, args: argparse.Namespace) -> int:
    _check(cfg)
    if cfg.engine.threads is not None:
        import torch

        torch.set_num_threads(cfg.engine.threads)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.role == "target":
        return _serve_target(cfg)
    return _serve_http(cfg)


def _serve_target(cfg: ServeConfig) -> int:
    from serving.distributed.verify_service import serve_target

    target_ref = cfg.target_model
    if target_ref is None:
        # Only the target's name is needed here: router.pt read and checked as every role reads
        # it, without loading the router's embedder.
        from routing.router_file import read_router_file

        target_ref = read_router_file(cfg.router)["target_ref"]
    e = cfg.engine.resolved(target_ref)
    print(e.precision_line(target_ref), file=sys.stderr, flush=True)
    serve_target(
        target_ref, e, host=cfg.host, port=cfg.port, session_timeout_s=cfg.session_timeout_s,
        batch_window_ms=cfg.batch_window_ms, token=None if cfg.grpc.node_tokens else cfg.grpc.resolved_token(),
        node_tokens=cfg.grpc.node_tokens, max_sessions_per_node=cfg.grpc.max_sessions_per_node,
        tls=(cfg.grpc.read("tls_cert"), cfg.grpc.read("tls_key")) if cfg.grpc.tls_cert else None,
    )  # fmt: skip
    return 0


def _check(cfg: ServeConfig) -> None:
    """Fail fast, before any model loads, on what the config alone shows to be wrong."""
    if cfg.role != "target" and cfg.host not in LOOPBACK and cfg.resolved_api_key() is None:
        log.warning("serve listens on %s without an API key: anyone who reaches the port can generate; set api_key "
                    "(--api-key, or CHORAL_API_KEY)", cfg.host)  # fmt: skip
    if cfg.backend == "vllm":
        _check_fleet(cfg)
    elif cfg.role in ("fused", "draft") and cfg.router is None:
        raise ConfigError(f"role={cfg.role} needs a router: pass --router router.pt")
    if cfg.router is not None and not Path(cfg.router).is_file():
        raise ConfigError(f"router file {cfg.router} does not exist; build one with train-router")
    if cfg.router is not None:
        from routing.router_file import RouterError, read_router_file

        try:  # every role: the same checks and messages, before any model loads
            saved = read_router_file(cfg.router)
        except RouterError as e:
            raise ConfigError(str(e)) from None
        from serving.engine.engine_settings import is_model_ref
        from serving.engine.models import check_model_ref

        # What this node loads, each named with where it was named: the target (every role loads
        # it or its tokenizer) and, but on the target node, the router's drafts.
        refs = {"the target": cfg.target_model or saved["target_ref"]}
        if cfg.backend == "vllm":  # the replicas load the models; the front loads only the router
            refs = {}
        elif cfg.role != "target":
            refs |= {f"draft {name!r}": ref for name, ref in (saved.get("draft_refs") or {}).items() if is_model_ref(ref)}
        for what, ref in refs.items():
            try:
                check_model_ref(ref)
            except FileNotFoundError as e:
                where = "target_model" if what == "the target" and cfg.target_model else f"router file {cfg.router}"
                raise ConfigError(f"{where} names {what} = {ref}: {e}; retrain the router (train-router) or put the "
                                  "model back where it is named") from None  # fmt: skip
    if cfg.role == "draft" and not cfg.target_address:
        raise ConfigError("role=draft needs the target service's address: pass --target HOST:PORT")
    for which in ("tls_cert", "tls_key", "tls_ca"):
        if getattr(cfg.grpc, which) is not None:
            try:
                cfg.grpc.read(which)
            except ValueError as e:
                raise ConfigError(str(e)) from None
    if (cfg.role == "target" and cfg.host not in LOOPBACK and cfg.grpc.resolved_token() is None
            and not cfg.grpc.node_tokens):  # fmt: skip
        log.warning("serve --role target listens on %s without a token: any client that reaches the port can open "
                    "sessions; set grpc.token (or CHORAL_GRPC_TOKEN) on the target and every draft node", cfg.host)
    if cfg.role == "target" and cfg.router is None and cfg.target_model is None:
        raise ConfigError("role=target needs the target model: pass --router router.pt or target_model=REF")
    if cfg.role == "target":
        from serving.distributed.verify_service import unsupported_on_target

        if (why := unsupported_on_target(cfg.engine)) is not None:
            raise ConfigError(why)
    if cfg.role == "target" and cfg.engine.quantize is not None:
        raise ConfigError(f"role=target verifies with the target as loaded: engine.quantize={cfg.engine.quantize} "
                          "is not supported there; drop it (the drafts' own precision is engine.draft_weights)")  # fmt: skip


def _check_fleet(cfg: ServeConfig) -> None:
    """backend=vllm: the fleet file parses and its pools' drafters are names the router knows
    (its profile is checked when the fleet front is made, before the app starts)."""
    fleet = load_config(FleetConfig, cfg.fleet)  # a ConfigError names the file and the key
    if cfg.router is not None and Path(cfg.router).is_file():
        from routing.router import NONE
        from routing.router_file import RouterError, read_router_file

        try:
            known = set(read_router_file(cfg.router)["draft_names"]) | {NONE}
        except RouterError as e:
            raise ConfigError(str(e)) from None
        for pool in fleet.pools:
            if pool.drafter not in known:
                raise ConfigError(f"{cfg.fleet}: pool {pool.name!r} has drafter={pool.drafter!r}, which router file "
                                  f"{cfg.router} does not know; use one of {', '.join(sorted(known))}")  # fmt: skip


def _serve_http(cfg: ServeConfig) -> int:
    # The HTTP side is imported here, when it serves, and nowhere else in this module: it imports
    # torch (the engine backend, the request types' bounds), which `serve --describe` must not
    # load, and the fleet front needs httpx, the optional [vllm] extra.
    import uvicorn

    from serving.server.app import create_app
    from serving.server.connections import uvicorn_config

    if cfg.backend == "vllm":
        from serving.server.vllm_backend import FleetServer

        backend = FleetServer(cfg)  # a fleet profile that is missing, or lacks a pool's draft, fails here
    else:
        from serving.server.server import EngineServer

        backend = EngineServer(cfg)
    failed: list[BaseException] = []

    def on_load_error(e: BaseException) -> None:
        failed.append(e)
        server.should_exit = True

    app = create_app(backend, cfg, on_load_error)
    server = uvicorn.Server(uvicorn_config(app, cfg))
    server.run()
    if failed:
        CLI.fail(f"loading failed: {type(failed[0]).__name__}: {failed[0]}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
