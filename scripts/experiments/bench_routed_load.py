"""Routed serving under load against every fixed drafter (issue 30's load point).

    python scripts/experiments/bench_routed_load.py --router runs/workload/router/router.pt \\
        --per-family 4 --max-tokens 48 --rounds 1 --out runs/routed-load

For each policy in turn it starts a fresh ``serve --router R`` (int8 target, batch 8, engine K 4,
the router's K and drafter applied per request for the batch it joins, the fallback on; fresh, so
that ``suffix``'s cache never holds an answer another policy produced), then sends the same mixed requests
(``--per-family`` test-split prompts of each of the six families, interleaved) from 8 concurrent
streaming clients once per policy: ``routed`` (the router chooses drafter and K), and each
drafter forced (``draft`` body field: the router is skipped and the engine's fixed K is used),
``none`` included. Policies take turns in an order that rotates each round. Reported: aggregate
completion tokens/s per policy, routed over the best fixed drafter, the router's choices, the
fallbacks, and whether every greedy answer equals the target alone's (``none``) text.
Writes ``routed_load.json`` and ``routed_load.md`` under ``--out``.

A policy is ``NAME[@K][+goodput]``: ``suffix@1`` forces ``suffix`` with the engine's K at 1 (a
fixed drafter with another fixed K), ``routed+goodput`` routes with ``engine.step_k=goodput`` (each
step caps the rows' K at the batch's best goodput, priced with steps timed at load and the
router's step table).
The best fixed drafter is the best policy that is neither routed nor goodput.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from routing.workload_eval import trained_precisions
from serving.server.launch import free_port, stop, wait_healthy
from serving.tools.load_test import amain, build_parser

POLICIES = ("routed", "suffix", "ngram", "base", "none")


def parse_policy(policy: str) -> tuple[str, int | None, bool]:
    """``NAME[@K][+goodput]`` -> (drafter or "routed", the engine's K or None for 4, goodput)."""
    head, plus, tail = policy.partition("+")
    if plus and tail != "goodput":
        raise SystemExit(f"policy {policy!r}: only +goodput may follow the name (NAME[@K][+goodput])")
    name, at, k = head.partition("@")
    if at and not (k.isdigit() and int(k) >= 1):
        raise SystemExit(f"policy {policy!r}: K after @ must be a positive integer, e.g. suffix@1")
    return name, int(k) if at else None, bool(plus)


def is_fixed(policy: str) -> bool:
    """A fixed drafter with a fixed K: what routed serving must beat."""
    name, _, goodput = parse_policy(policy)
    return name != "routed" and not goodput


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", required=True)
    ap.add_argument("--per-family", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--policies", default=",".join(POLICIES), help="routed and drafter names to force")
    ap.add_argument("--target-weights", choices=["fp32", "int8", "q4"], default=None,
                    help="the served target's precision (default: the one the router's rows were collected at)")
    ap.add_argument("--draft-weights", choices=["auto", "fp32", "int8", "q4"], default=None,
                    help="the served drafts' precision (default: the router's rows', else auto)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra serve key=value overrides")
    ap.add_argument("--out", default="runs/routed-load")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    policies = [p.strip() for p in args.policies.split(",")]
    trained_target, trained_drafts = trained_precisions(args.router)
    target_weights, draft_weights = args.target_weights or trained_target, args.draft_weights or trained_drafts
    results: dict[str, list[dict]] = {p: [] for p in policies}
    fallbacks = 0.0
    n = args.per_family * 6
    for r in range(args.rounds):
        for j in range(len(policies)):
            policy = policies[(r + j) % len(policies)]
            name, k, goodput = parse_policy(policy)
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            cmd = ["serve", "--router", args.router, f"port={port}", f"engine.target_weights={target_weights}",
                   f"engine.draft_weights={draft_weights}", "engine.max_batch_size=8", f"engine.k={k or 4}",
                   "log_level=warning", *(["engine.step_k=goodput"] if goodput else []), *args.serve_arg]  # fmt: skip
            with open(out / f"serve-{policy}-{r}.log", "w") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
                try:
                    wait_healthy(url, proc, timeout_s=900)
                    lt = ["--url", url, "--families", "all", "--split", "test", "--n-prompts", str(args.per_family),
                          "--requests", str(n), "--concurrency", str(args.concurrency), "--max-tokens", str(args.max_tokens),
                          "--quiet", "--out", str(out / f"lt-{policy}-{r}")]  # fmt: skip
                    if name != "routed":
                        lt += ["--draft", name]
                    report = asyncio.run(amain(build_parser().parse_args(lt)))
                    with urllib.request.urlopen(url + "/metrics", timeout=10) as m:
                        fallbacks += sum(float(line.split()[-1]) for line in m.read().decode().splitlines()
                                         if line.startswith("choral_drafter_fallbacks_total{"))  # fmt: skip
                finally:
                    stop([proc], timeout_s=60)
            results[policy].append(report)
            print(f"round {r} {policy}: {report['throughput_tokens_per_s']:.2f} tok/s, errors {report['errors']}", flush=True)
    summary = summarize(results, policies)
    summary["fallbacks_total"] = fallbacks
    report = {"command": " ".join(["python scripts/experiments/bench_routed_load.py", *(argv if argv is not None else sys.argv[1:])]),
              "machine": f"{os.cpu_count()} cpus", "summary": summary,
              "runs": {p: [{k: v for k, v in r.items() if k != "rows"} | {"requests": [compact(row) for row in r["rows"]]}
                           for r in rs] for p, rs in results.items()}}  # fmt: skip
    tmp = out / ".routed_load.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out / "routed_load.json")
    md = markdown(report)
    (out / "routed_load.md").write_text(md)
    print(md)
    return 0


def compact(row: dict) -> dict:
    """What one request did, without its text: the drafter it ran, its acceptance and tokens per
    target call (to see where a policy gained or lost)."""
    return {k: row.get(k) for k in ("prompt_id", "ok", "draft", "acceptance", "tokens_per_target_call", "completion_tokens", "e2e_ms")}


def summarize(results: dict[str, list[dict]], policies: list[str]) -> dict:
    tps = {p: sum(r["completion_tokens"] for r in rs) / sum(r["wall_s"] for r in rs) for p, rs in results.items()}
    fixed = [p for p in policies if is_fixed(p)]
    best = max(fixed, key=lambda p: tps[p]) if fixed else None
    routed = max((p for p in policies if parse_policy(p)[0] == "routed"), key=lambda p: tps[p], default=None)
    texts = {p: {row["prompt_id"]: row["text"] for r in rs for row in r["rows"]} for p, rs in results.items()}
    # Greedy answers must equal the target alone's; without a `none` run, the first policy's.
    reference = "none" if "none" in texts else next(iter(texts), None)
    ref = texts.get(reference, {})
    identical = {p: sum(ref.get(i) == t for i, t in ts.items()) for p, ts in texts.items() if p != reference}
    choices: dict[str, int] = {}
    for r in results.get(routed, []):
        for row in r["rows"]:
            choices[row["draft"]] = choices.get(row["draft"], 0) + 1
    # Paired by round (the policies of one round run back to back, so machine drift between rounds
    # cancels): routed over the best fixed policy in each round.
    per_round = ([a["throughput_tokens_per_s"] / b["throughput_tokens_per_s"] for a, b in zip(results[routed], results[best])]
                 if best and routed else [])  # fmt: skip
    return {"tokens_per_s": tps, "best_fixed": best, "best_routed": routed,
            "routed_vs_best_fixed": tps[routed] / tps[best] if best and routed else None,
            "routed_vs_best_fixed_per_round": per_round,
            "identity_reference": reference, "identical_to_reference": identical, "answers": {p: len(ts) for p, ts in texts.items()}, "routed_choices": choices,
            "errors": {p: sum(r["errors"] for r in rs) for p, rs in results.items()}}  # fmt: skip


def markdown(report: dict) -> str:
    s = report["summary"]
    reference = s.get("identity_reference", "none")
    identical = s.get("identical_to_reference", s.get("identical_to_none", {}))  # the key before the reference could vary
    lines = [f"`{report['command']}`", "", f"| policy | tok/s | identical to {reference} | errors |", "|---|---|---|---|"]
    for p, v in s["tokens_per_s"].items():
        ident = "-" if p == reference else f"{identical[p]}/{s['answers'][p]}"
        lines.append(f"| {p} | {v:.2f} | {ident} | {s['errors'][p]} |")
    if s["routed_vs_best_fixed"] is not None:
        lines += ["", f"Best routed ({s['best_routed']}) / best fixed ({s['best_fixed']}): {s['routed_vs_best_fixed']:.3f}. Router's choices: "
                  + ", ".join(f"{k} {v}" for k, v in sorted(s["routed_choices"].items()))
                  + f". Fallbacks: {s['fallbacks_total']:.0f}. Per round (paired): "
                  + ", ".join(f"{x:.3f}" for x in s.get("routed_vs_best_fixed_per_round", [])) + "."]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
