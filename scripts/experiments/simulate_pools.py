"""Drafter-specialised replica pools against homogeneous ones at fleet scale, in the simulator
(serving/fleet/simulator.py, fused servers), fed by a profile measured through the vLLM backend.

    python scripts/experiments/simulate_pools.py --profile runs/vllm-fleet/profile.sim.yaml \
        --replicas 100 --out runs/simulate-pools

Every deployment has the same ``--replicas`` servers and the same closed-loop clients
(``--clients-per-replica``, each asking again ``--think-s`` after its answer):

* ``homogeneous none``: every replica runs the target alone;
* ``homogeneous <draft>``: every replica runs that drafter (one vLLM speculative config);
* ``specialised``: one pool per drafter that is best for some domain at the batch a replica runs
  (about ``--clients-per-replica`` rows), sized to the work it gets (its domains' share of requests
  x their tokens / the pool's predicted tokens per second at that batch), each request sent to the
  pool of its domain's best drafter;
* ``per-request (any)``: every replica can run every drafter (Choral's own engine), for reference.

Writes ``pools.json`` and ``pools.md``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from serving.config import load_config
from serving.fleet.profile import load_profile
from serving.fleet.simulator import NONE, SimulateConfig, Simulation, simulate


def config(args: argparse.Namespace, targets: list[dict], draft: dict) -> SimulateConfig:
    n_clients = args.replicas * args.clients_per_replica
    overrides = [
        f"duration_s={args.duration_s}", f"warmup_s={args.warmup_s}", "architecture=fused", f"seed={args.seed}",
        f"clients={{client: {n_clients}}}", "devices={client: {draft_speed: 1.0, link: {latency_ms: 1.0, bandwidth_mbps: 10000}}}",
        f"targets={json.dumps(targets)}", f"draft={json.dumps(draft)}", f"k.k={args.k}", "balancer=jsq",
        f"arrivals={json.dumps({'kind': 'closed', 'think_time_s': args.think_s})}", "output.plots=false",
    ]  # fmt: skip
    if args.target_cost:
        overrides.append(f"target_cost={args.target_cost}")
    return load_config(SimulateConfig, None, overrides)


def deployments(args: argparse.Namespace, profile) -> dict[str, tuple[list[dict], dict]]:
    group = {"speed": 1.0, "max_batch": args.max_batch, "draft_speed": args.draft_speed}
    drafts = list(profile.drafts)
    out = {"homogeneous none": ([dict(group, count=args.replicas, pool=NONE)], {"policy": "fixed", "name": NONE})}
    for d in drafts:
        out[f"homogeneous {d}"] = ([dict(group, count=args.replicas, pool=d)], {"policy": "fixed", "name": d})
    # The router's pick per domain among every drafter and none, from a probe simulation's setup.
    # (A 'none' pool beside an any-drafter server makes 'none' one of the router's options.)
    probe = Simulation(config(args, [dict(group, count=1, pool=NONE), dict(group, count=1)], {"policy": "router"}), profile)
    # A pool is judged at the batch its replicas will run: about --clients-per-replica rows (up to
    # --max-batch). A lone step flatters speculation wherever a batched verify costs more per row.
    rows = max(1, min(args.max_batch, args.clients_per_replica))

    def lone_step(i: int, j: int) -> tuple[float, float]:
        """(tokens, ms) per row of drafter i's step on domain j at ``rows`` rows (--target-cost applied)."""
        return probe.lone_step(i, j, args.draft_speed, rows)

    # The pick per domain: the best tokens per second per row at that batch.
    chosen = {d: probe.draft_names[max(range(len(probe.draft_names)), key=lambda i: (lambda t, ms: t / ms)(*lone_step(i, j)))]
              for j, d in enumerate(probe.domains)}  # fmt: skip
    work: dict[str, float] = {}
    for j, d in enumerate(probe.domains):
        share = profile.domains[d].weight / sum(x.weight for x in profile.domains.values())
        name = chosen[d]
        tokens, step_ms = lone_step(probe.draft_names.index(name), j)
        out_len = profile.domains[d].output_tokens
        mean_out = sum(out_len.samples) / len(out_len.samples) if out_len.samples else out_len.mean
        work[name] = work.get(name, 0.0) + share * mean_out * step_ms / tokens
    total = sum(work.values())
    counts = {name: max(1, round(args.replicas * w / total)) for name, w in work.items()}
    biggest = max(counts, key=counts.get)
    counts[biggest] += args.replicas - sum(counts.values())  # exactly --replicas in all
    out["specialised"] = ([dict(group, count=c, pool=name) for name, c in counts.items()], {"policy": "router", "table": chosen})
    out["per-request (any)"] = ([dict(group, count=args.replicas)], {"policy": "router", "table": chosen})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", required=True, help="bench_vllm_fleet.py profile's profile.sim.yaml")
    ap.add_argument("--drafts-from", action="append", default=[],
                    help="another measured profile of the same hardware whose drafters join --profile's (one pool "
                         "measured per profile run); repeatable")
    ap.add_argument("--replicas", type=int, default=100)
    ap.add_argument("--clients-per-replica", type=int, default=8)
    ap.add_argument("--think-s", type=float, default=2.0)
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--k", type=int, default=4, help="the pools' num_speculative_tokens")
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--warmup-s", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-cost", default=None, help="what-if hardware: a CostModel as YAML/JSON replacing the "
                    "profile's target, e.g. '{base_ms: 25, per_row_ms: 0.3, per_token_ms: 0.15}' (say so beside the numbers)")
    ap.add_argument("--draft-speed", type=float, default=1.0, help="what-if: draft forwards this many times faster than measured")
    ap.add_argument("--out", default="runs/simulate-pools")
    args = ap.parse_args(argv)
    profile = load_profile(args.profile)
    for extra in args.drafts_from:  # drafters measured in other profile runs on the same hardware
        for name, draft in load_profile(extra).drafts.items():
            profile.drafts.setdefault(name, draft)
    rows = []
    for name, (targets, draft) in deployments(args, profile).items():
        t0 = time.perf_counter()
        r = simulate(config(args, targets, draft), profile)
        s = r["summary"]
        rows.append({"deployment": name, "pools": {g.get("pool") or "any": g["count"] for g in targets},
                     "per_domain_draft": r["per_domain_draft"], "tokens_per_s": s["throughput_tokens_per_s"],
                     "tpot_p50_ms": s["tpot_ms"]["p50"], "e2e_p50_ms": s["e2e_ms"]["p50"], "e2e_p99_ms": s["e2e_ms"]["p99"],
                     "utilisation_mean": s["utilisation_mean"], "per_pool": r["per_pool"]})  # fmt: skip
        print(f"{name}: {s['throughput_tokens_per_s']:.0f} tok/s, e2e p50 {s['e2e_ms']['p50']:.0f} ms "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {"command": vars(args) | {"date": time.strftime("%Y-%m-%d")}, "profile_meta": profile.meta, "rows": rows}
    (out / "pools.json").write_text(json.dumps(record, indent=2) + "\n")
    base = rows[0]["tokens_per_s"]
    hardware = "measured" if not args.target_cost and args.draft_speed == 1.0 else (
        f"what-if: target_cost={args.target_cost}, draft_speed={args.draft_speed}")
    lines = [f"{args.replicas} replicas, {args.replicas * args.clients_per_replica} closed-loop clients (think {args.think_s} s), "
             f"K {args.k}, {args.duration_s:.0f} simulated s; profile {args.profile}; hardware {hardware}", "",
             "| deployment | replicas per pool | domain -> drafter | tokens/s | vs none | TPOT p50 ms | e2e p50 ms | e2e p99 ms |",
             "|---|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in rows:
        pools = ", ".join(f"{k} {v}" for k, v in r["pools"].items())
        choice = ", ".join(f"{d} {x}" for d, x in r["per_domain_draft"].items())
        lines.append(f"| {r['deployment']} | {pools} | {choice} | {r['tokens_per_s']:.0f} | {r['tokens_per_s'] / base:.2f}x | "
                     f"{r['tpot_p50_ms']:.0f} | {r['e2e_p50_ms']:.0f} | {r['e2e_p99_ms']:.0f} |")  # fmt: skip
    (out / "pools.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
