"""serve: the OpenAI-compatible server with routed speculative decoding.

    serve --router runs/router/router.pt                              # fused: everything here
    serve --router router.pt --config configs/serve.yaml port=8001 max_batch_size=4
    serve --role target --router router.pt port=50051                 # gRPC verification service
    serve --role draft --target 127.0.0.1:50051 --router router.pt    # HTTP API + drafts
    serve --describe                                                  # every config key

Flags are shorthands for config keys (``--router X`` is ``router=X``); ``key=value`` overrides
come last and win.
"""

from __future__ import annotations

import argparse
import logging
import sys

from serving.config import ConfigError, describe, load_config
from serving.serve_config import ServeConfig


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="serve", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n", 2)[2])  # fmt: skip
    ap.add_argument("--config", help="YAML config (configs/serve.yaml); keys as in --describe")
    ap.add_argument("--router", help="router.pt (fused and draft roles)")
    ap.add_argument("--role", choices=["fused", "target", "draft"], help="default: fused")
    ap.add_argument("--target", help="role=draft: HOST:PORT of the target service")
    ap.add_argument("--host", help="listen address")
    ap.add_argument("--port", type=int, help="listen port")
    ap.add_argument("--describe", action="store_true", help="print every config key with its default and exit")
    ap.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. max_batch_size=4")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.describe:
        print(describe(ServeConfig))
        return 0
    flags = {"router": args.router, "role": args.role, "target_address": args.target, "host": args.host, "port": args.port}
    overrides = [f"{k}={v}" for k, v in flags.items() if v is not None] + list(args.overrides)
    try:
        cfg = load_config(ServeConfig, args.config, overrides)
        _check(cfg)
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"serve: error: {e}", file=sys.stderr)
        return 2
    if cfg.threads is not None:
        import torch

        torch.set_num_threads(cfg.threads)
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if cfg.role == "target":
        return _serve_target(cfg)
    return _serve_http(cfg)


def _serve_target(cfg: ServeConfig) -> int:
    from serving.engine import EngineConfig
    from serving.verify_service import serve_target

    target_ref = cfg.target_model
    if target_ref is None:
        # Only the target's name is needed here: read it from router.pt without loading the
        # router's embedder (router.pt is a plain dict; see routing.router.Router.to_dict).
        import torch

        target_ref = torch.load(cfg.router, map_location="cpu", weights_only=True)["target_ref"]
    serve_target(
        target_ref, host=cfg.host, port=cfg.port, device=cfg.device, dtype=cfg.dtype,
        max_batch_size=cfg.max_batch_size, max_len=cfg.max_len, k_buckets=EngineConfig().k_buckets,
        session_timeout_s=cfg.session_timeout_s, batch_window_ms=cfg.batch_window_ms,
        cpu_kernels=cfg.cpu_kernels and cfg.compile_backend is None,
    )  # fmt: skip
    return 0


def _check(cfg: ServeConfig) -> None:
    """Fail fast, before any model loads, on what the config alone shows to be wrong."""
    from pathlib import Path

    if cfg.role in ("fused", "draft") and cfg.router is None:
        raise ValueError(f"role={cfg.role} needs a router: pass --router router.pt")
    if cfg.router is not None and not Path(cfg.router).is_file():
        raise FileNotFoundError(f"router file {cfg.router} does not exist; build one with train-router")
    if cfg.role == "draft" and not cfg.target_address:
        raise ValueError("role=draft needs the target service's address: pass --target HOST:PORT")
    if cfg.role == "target" and cfg.router is None and cfg.target_model is None:
        raise ValueError("role=target needs the target model: pass --router router.pt or target_model=REF")


def _serve_http(cfg: ServeConfig) -> int:
    import uvicorn

    from serving.server import create_app

    failed: list[BaseException] = []

    def on_load_error(e: BaseException) -> None:
        failed.append(e)
        server.should_exit = True

    app = create_app(cfg, on_load_error=on_load_error)
    server = uvicorn.Server(uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level))
    server.run()
    if failed:
        print(f"serve: error: loading failed: {type(failed[0]).__name__}: {failed[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
