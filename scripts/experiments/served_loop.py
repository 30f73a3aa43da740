"""The served-traffic loop, end to end (issue 30): serve a shifted workload, log it, retrain, and
measure the new router against the old one on held-out prompts of that workload.

    python scripts/experiments/served_loop.py --router runs/workload/router/router.pt \\
        --config configs/workload_router.yaml --serve-prompts 24 --eval-prompts 8 --explore 0.5 --out runs/served-loop-explore

1. ``serve --router R0`` (the target and drafts at the precisions R0's rows were collected at,
   ``routing.log_requests``, ``routing.explore`` with ``--explore``) answers the train split of the shifted family (``serving.workload.SHIFTED``: port a standard-library function to Rust, a kind
   of request the six families never had) from 4 concurrent clients; every routed request is
   logged as a row.
2. ``train-router --config C served=[served.jsonl]`` trains R1 on the same collected rows plus the
   log (the same settings as R0's config).
3. On the shifted family's test split (prompts neither router saw), the target alone, every single
   drafter and both routers run in turn per prompt (``routing.workload_eval``): R0's and R1's
   speedups before and after, and every output checked against the target alone.
Writes ``served_loop.json`` and ``served_loop.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

from routing import workload_eval
from routing.router import Router
from routing.rows import read_rows
from serving.engine.engine_settings import EngineSettings
from serving.server.launch import free_port, stop, wait_healthy
from serving.tools.load_test import amain, build_parser
from serving.workload import SHIFTED, load_family


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", required=True, help="R0, the router trained without the log")
    ap.add_argument("--config", required=True, help="train-router config R0 was trained with")
    ap.add_argument("--serve-prompts", type=int, default=12, help="shifted train-split prompts to serve and log")
    ap.add_argument("--eval-prompts", type=int, default=8, help="shifted test-split prompts to measure on")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--explore", type=float, default=0.0,
                    help="routing.explore while serving: the share of requests sent to another drafter, so the log "
                         "measures drafters R0 would not pick (0: R0's choices only)")
    ap.add_argument("--out", default="runs/served-loop")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = out / "served.jsonl"
    target_weights, draft_weights = workload_eval.trained_precisions(args.router)  # what R0's rows describe

    # 1. Serve the shifted workload with R0 and log it.
    if not log.exists() or len(read_rows(log)) < args.serve_prompts:
        log.unlink(missing_ok=True)
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = ["serve", "--router", args.router, f"port={port}", f"engine.target_weights={target_weights}",
               f"engine.draft_weights={draft_weights}", "engine.max_batch_size=4",
               "engine.k=4", "log_level=warning", f"routing.log_requests={log}", f"routing.explore={args.explore}"]  # fmt: skip
        with open(out / "serve.log", "w") as serve_log:
            proc = subprocess.Popen(cmd, stdout=serve_log, stderr=subprocess.STDOUT)
            try:
                wait_healthy(url, proc, timeout_s=900)
                lt = ["--url", url, "--families", SHIFTED, "--split", "train", "--n-prompts", str(args.serve_prompts),
                      "--requests", str(args.serve_prompts), "--concurrency", "4", "--max-tokens", str(args.max_tokens),
                      "--quiet", "--out", str(out / "serve-load")]  # fmt: skip
                served = asyncio.run(amain(build_parser().parse_args(lt)))
            finally:
                stop([proc], timeout_s=60)
        print(f"served {served['n_requests']} shifted requests, {served['errors']} errors; log: {len(read_rows(log))} rows")

    # 2. Retrain with the log.
    after = out / "router-after"
    subprocess.run(["train-router", "--config", args.config, f"served=[{log}]", f"output={after}"], check=True)

    # 3. Before and after on held-out shifted prompts.
    routers = {"before": Router.load(args.router), "after": Router.load(after / "router.pt")}
    prompts = load_family(SHIFTED, "test", args.eval_prompts)
    settings = EngineSettings(target_weights=target_weights, draft_weights=draft_weights, k=4, request_k_max=8,
                              max_batch_size=1)  # fmt: skip
    report = workload_eval.measure(routers, prompts, max_new_tokens=args.max_tokens, settings=settings)
    report["config"] |= {"router_before": args.router, "router_after": str(after / "router.pt"), "served_rows": len(read_rows(log)),
                         "served_choices": _choices(read_rows(log)),
                         "command": " ".join(["python scripts/experiments/served_loop.py", *(argv if argv is not None else sys.argv[1:])])}  # fmt: skip
    tmp = out / ".served_loop.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out / "served_loop.json")
    md = workload_eval.markdown(report)
    (out / "served_loop.md").write_text(md)
    print(md)
    print("served rows' drafters:", report["config"]["served_choices"])
    return 0


def _choices(rows: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[r["draft"]] = out.get(r["draft"], 0) + 1
    return out


if __name__ == "__main__":
    raise SystemExit(main())
