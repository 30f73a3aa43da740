"""Routed vLLM pools against each pool alone, through ``serve --backend vllm`` (issue: the router
in front of vLLM replicas). Two steps, both against running servers:

    # 1. profile: each pool's step cost in target steps, measured one request at a time on its
    #    replicas (validation prompts), written into a copy of the fleet file
    python scripts/experiments/bench_vllm_fleet.py profile --fleet runs/fleet/fleet.yaml \
        --offset 40 --prompts-per-domain 3 --out runs/vllm-fleet
    # 2. start `serve --backend vllm --fleet runs/vllm-fleet/fleet.profiled.yaml --router router.pt`, then
    python scripts/experiments/bench_vllm_fleet.py run --front http://127.0.0.1:8000 \
        --fleet runs/vllm-fleet/fleet.profiled.yaml --offset 0 --prompts-per-domain 8 --clients 8 --out runs/vllm-fleet

``run`` first decodes every prompt with the target alone, one at a time (a replica of the ``none``
pool, asked directly): every output below must equal it (greedy). Then the same mixed requests are sent by ``--clients`` concurrent clients under each policy: ``routed`` (the
router's choice), every request forced to one pool, and ``split`` (each request to a pool by a hash
of its index: the same hardware as routing, without the router's choice). Policies are interleaved
over ``--repeats`` rounds (ABCD, DCBA, ...) so drift on a shared machine hits them alike. Writes
``run.json`` and ``run.md`` (and ``profile.json``, ``profile.sim.yaml`` for
scripts/experiments/simulate_pools.py, and ``fleet.profiled.yaml``, which names that profile so the
front ranks pools at their replicas' load). ``faults --kill URL`` kills that replica mid-load and
tallies what every request got (``faults.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import yaml
from prometheus_client.parser import text_string_to_metric_families

from serving.config import load_config
from serving.fleet.fleet_file import NONE, FleetConfig
from serving.prompts import Prompt, load_prompts

SPEC = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def prompts_for(domains: list[str], n: int, offset: int) -> list[Prompt]:
    return [p for d in domains for p in load_prompts(d, n, offset=offset)]


def ask(client: openai.OpenAI, model: str, p: Prompt, max_tokens: int, draft: str | None = None) -> dict:
    """One greedy request (chat template or raw completion, as the prompt says); text, tokens, time, choral."""
    extra = {"draft": draft} if draft else None
    t0 = time.perf_counter()
    if p.use_chat_template:
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": p.text}],
                                             max_tokens=max_tokens, temperature=0, extra_body=extra)  # fmt: skip
        text = out.choices[0].message.content
    else:
        out = client.completions.create(model=model, prompt=p.text, max_tokens=max_tokens, temperature=0, extra_body=extra)
        text = out.choices[0].text
    return {"id": p.id, "domain": p.domain, "text": text, "tokens": out.usage.completion_tokens,
            "prompt_tokens": out.usage.prompt_tokens,
            "s": time.perf_counter() - t0, "choral": (out.model_extra or {}).get("choral")}  # fmt: skip


def spec_counters(url: str) -> dict:
    """vLLM's speculative counters (totals), and accepted tokens per draft position."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    out: dict = {n: sum(s.value for s in fams[n].samples if s.name.endswith("_total")) for n in SPEC if n in fams}
    if PER_POS in fams:
        out[PER_POS] = {int(s.labels["position"]): s.value for s in fams[PER_POS].samples if s.name.endswith("_total")}
    return out


def model_id(url: str) -> str:
    return json.loads(urllib.request.urlopen(f"{url}/v1/models", timeout=10).read())["data"][0]["id"]


def together(client: openai.OpenAI, model: str, prompts: list[Prompt], max_tokens: int) -> tuple[list[dict], float]:
    """The answers to ``prompts`` sent all at once, and the wall seconds until the last one."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as ex:
        answers = list(ex.map(lambda p: ask(client, model, p, max_tokens), prompts))
    return answers, time.perf_counter() - t0


def profile(args: argparse.Namespace) -> int:
    fleet = load_config(FleetConfig, args.fleet)
    prompts = prompts_for(args.domains, args.prompts_per_domain, args.offset)
    plain = next(p for p in fleet.pools if p.drafter == NONE)
    base_url = plain.replicas[0]
    base = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0, timeout=600)
    mid = model_id(base_url)
    ask(base, mid, prompts[0], 8)  # warm-up
    alone = [ask(base, mid, p, args.max_tokens) for p in prompts]
    s0 = sum(r["s"] for r in alone) / sum(r["tokens"] for r in alone)  # seconds per target step (and token)
    # The target's batched step: --batch requests at once (each step advances every row one token).
    batched, wall = together(base, mid, prompts[: args.batch], args.max_tokens)
    s_batch = wall / max(r["tokens"] for r in batched)
    result = {"prompts": len(prompts), "target_s_per_token": s0, "target_s_per_step_batched": s_batch,
              "batch": len(batched), "pools": {}}  # fmt: skip
    sim_drafts = {}
    drafting = [p.drafter for p in fleet.pools if p.drafter != NONE]
    if len(set(drafting)) < len(drafting):  # the profile keys a drafter's costs by its name
        raise SystemExit(f"bench_vllm_fleet profile: {args.fleet} has several pools of one drafter ({', '.join(drafting)}); "
                         "profile a fleet file with one pool per drafter")  # fmt: skip
    out_fleet = yaml.safe_load(Path(args.fleet).read_text())
    for i, pool in enumerate(fleet.pools):
        if pool.drafter == NONE:
            continue
        url = pool.replicas[0]
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=600)
        ask(client, mid, prompts[0], 8)
        before, rows, curves, proposes = spec_counters(url), [], {}, {}
        # Steps are counted as tokens less accepted tokens (each step emits its accepted drafts plus
        # one), not as vLLM's num_drafts: a drafter that finds nothing to propose (ngram without a
        # match) runs a plain step that num_drafts leaves out. The curves are per decode step
        # likewise, and for a model-free method num_drafts / decode steps is the fraction of steps
        # that proposed (the simulator runs the others as plain one-token steps).
        for d in args.domains:  # per domain: the acceptance curve the simulator draws from
            start = spec_counters(url)
            got = [ask(client, mid, p, args.max_tokens) for p in prompts if p.domain == d]
            rows += got
            end = spec_counters(url)
            # Decode steps: tokens less accepted drafts, less each request's first token (its
            # prefill, where nothing is drafted; the simulator decodes in the prefill's iteration).
            steps_d = sum(r["tokens"] for r in got) - (end[SPEC[2]] - start[SPEC[2]]) - len(got)
            curves[d] = [min(1.0, (end[PER_POS].get(i, 0) - start[PER_POS].get(i, 0)) / steps_d) if steps_d > 0 else 0.0
                         for i in range(pool.k)]  # fmt: skip
            if pool.method in ("ngram", "suffix"):  # model-free: may find nothing to propose (a model always does)
                proposes[d] = min(1.0, (end[SPEC[0]] - start[SPEC[0]]) / steps_d) if steps_d > 0 else 0.0
                curves[d] = [min(c, proposes[d]) for c in curves[d]]
        after = spec_counters(url)
        drafted, accepted = after[SPEC[1]] - before[SPEC[1]], after[SPEC[2]] - before[SPEC[2]]
        seconds, tokens = sum(r["s"] for r in rows), sum(r["tokens"] for r in rows)
        steps = tokens - accepted  # every step, with or without a proposal
        step_cost = seconds / steps / s0 if steps else None
        result["pools"][pool.name] = {"steps": steps, "acceptance_rate": accepted / drafted if drafted else None,
                                      "tokens_per_step": tokens / steps if steps else None, "step_cost": step_cost,
                                      "speedup": (sum(r["s"] for r in alone) / seconds), "identical": sum(
                                          a["text"] == b["text"] for a, b in zip(alone, rows)) / len(rows)}  # fmt: skip
        out_fleet["pools"][i]["step_cost"] = round(step_cost, 4) if step_cost else None
        result["pools"][pool.name]["acceptance_by_position"] = curves
        result["pools"][pool.name]["proposes"] = proposes
        decode_steps = steps - len(rows)
        propose_rate = min(1.0, (after[SPEC[0]] - before[SPEC[0]]) / decode_steps) if proposes and decode_steps > 0 else 1.0
        # The pool's batched step: --batch requests at once, as for the target. A verify of K+1
        # tokens for every row costs far more than a plain batched step on a compute-bound CPU, which
        # neither lone measurement shows; the front ranks pools at their load with this point.
        start = spec_counters(url)
        at_once, wall = together(client, mid, prompts[: args.batch], args.max_tokens)
        end = spec_counters(url)
        tokens_b = sum(r["tokens"] for r in at_once)
        per_step = tokens_b / max(1, tokens_b - (end[SPEC[2]] - start[SPEC[2]]))  # tokens a row gains per step
        step_batched = wall / (max(r["tokens"] for r in at_once) / per_step)  # the longest row's steps
        result["pools"][pool.name]["batched"] = {"rows": len(at_once), "s_per_step": step_batched,
                                                 "tokens_per_step": per_step, "tokens_per_s": tokens_b / wall}  # fmt: skip
        sim_drafts[pool.drafter] = (step_cost * s0 if step_cost else None, pool.k, curves, proposes, propose_rate,
                                    (len(at_once), step_batched))  # fmt: skip
        print(f"pool {pool.name}: {result['pools'][pool.name]}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sim = sim_profile(s0, s_batch, len(batched), sim_drafts, alone, args)
    sim.save(out / "profile.sim.yaml")
    print(f"-> {out / 'profile.sim.yaml'}")
    result["command"] = vars(args) | {"date": time.strftime("%Y-%m-%d")}
    out_fleet["profile"] = str((out / "profile.sim.yaml").resolve())  # the front ranks pools at their load with it
    (out / "profile.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "fleet.profiled.yaml").write_text(yaml.safe_dump(out_fleet, sort_keys=False))
    print(f"-> {out / 'profile.json'}\n-> {out / 'fleet.profiled.yaml'}")
    return 0


def two_point_cost(s0: float, s_batch: float, batch: int):
    """A step (the target's, or a drafting pool's whole step) as a fixed cost plus a cost per token
    fed, through the step at 1 row and at ``batch`` rows. Per token rather than per row: the
    measured rows feed one token each, so the two cannot be told apart there, and on a
    compute-bound CPU (bf16 without AVX-512) a verify of K+1 tokens costs about K+1 plain steps'
    worth, which a per-row model would miss."""
    from serving.fleet.profile import CostModel, CostPoint

    per_token = max(0.0, (s_batch - s0) * 1e3 / (batch - 1)) if batch > 1 else 0.0
    points = [CostPoint(1, 1, s0 * 1e3), CostPoint(batch, 1, s_batch * 1e3)]
    return CostModel(base_ms=max(0.0, s0 * 1e3 - per_token), per_token_ms=per_token, points=points)


def sim_profile(s0: float, s_batch: float, batch: int, drafts: dict, alone: list[dict], args: argparse.Namespace):
    """A simulator profile (serving/fleet/profile.py) from what vLLM measured: the target's step
    at 1 row and at ``batch`` rows, each drafter's step at its K (its draft forwards: the step's
    measured time less the target's verify, split over K), its whole step at 1 row and at the
    pool's batched rows (``step``, what the front ranks pools at load with) and its acceptance by
    position and domain."""
    from serving.fleet.profile import CostModel, DomainProfile, DraftProfile, LengthDist, Profile

    target = two_point_cost(s0, s_batch, batch)
    sim_drafts = {}
    for name, (step_s, k, curves, proposes, rate, (rows_b, step_b)) in drafts.items():
        if step_s is None:
            continue
        # A mean step: on the proposing fraction, K draft forwards and a verify of K + 1 tokens; on
        # the rest, a plain step. A drafter that (almost) never proposed has no draft cost to tell.
        verify_ms = rate * target.ms(1, k + 1) + (1 - rate) * target.ms(1, 1)
        draft_ms = max(0.0, (step_s * 1e3 - verify_ms) / (k * rate)) if rate > 0.01 else 0.0
        step = two_point_cost(step_s, step_b, rows_b)  # the whole step through its lone and batched points
        sim_drafts[name] = DraftProfile(cost=CostModel(base_ms=draft_ms), acceptance=curves, proposes=proposes, step=step,
                                        step_k=k)
    prompt_tokens = {d: statistics.mean(r["prompt_tokens"] for r in alone if r["domain"] == d) for d in args.domains}
    domains = {d: DomainProfile(weight=1.0, prompt_tokens=LengthDist(mean=max(1.0, prompt_tokens[d])),
                                output_tokens=LengthDist(mean=float(args.max_tokens))) for d in args.domains}  # fmt: skip
    meta = {"source": "scripts/experiments/bench_vllm_fleet.py profile", "date": time.strftime("%Y-%m-%d"),
            "fleet": args.fleet, "max_tokens": args.max_tokens}  # fmt: skip
    return Profile(target=target, drafts=sim_drafts, domains=domains, meta=meta)


def run(args: argparse.Namespace) -> int:
    fleet = load_config(FleetConfig, args.fleet)
    prompts = prompts_for(args.domains, args.prompts_per_domain, args.offset)
    front = openai.OpenAI(base_url=f"{args.front}/v1", api_key=args.api_key, max_retries=0, timeout=600)
    model = front.models.list().data[0].id
    plain = next(p for p in fleet.pools if p.drafter == NONE)
    direct = openai.OpenAI(base_url=f"{plain.replicas[0]}/v1", api_key="x", max_retries=0, timeout=600)
    mid = model_id(plain.replicas[0])

    # 1. The target alone, one request at a time (a replica of the 'none' pool, asked directly):
    #    every output of the load rounds below is compared with it.
    print(f"the target alone: {len(prompts)} prompts", flush=True)
    alone = {p.id: ask(direct, mid, p, args.max_tokens)["text"] for p in prompts}

    # 2. Load: every policy sends the same requests from --clients concurrent clients.
    names = [p.name for p in fleet.pools]
    policies = ["routed", *(f"all:{n}" for n in names), "split"]

    def draft_of(policy: str, i: int) -> str | None:
        if policy == "routed":
            return None
        if policy == "split":
            return names[i % len(names)]
        return policy.removeprefix("all:")

    def one_round(policy: str) -> dict:
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.clients) as pool:
            rows = list(pool.map(lambda ip: ask(front, model, ip[1], args.max_tokens, draft_of(policy, ip[0])), enumerate(prompts)))
        wall = time.perf_counter() - t0
        tokens = sum(r["tokens"] for r in rows)
        by_domain = {}
        for r in rows:
            d = by_domain.setdefault(r["domain"], {"tokens": 0, "s": 0.0})
            d["tokens"] += r["tokens"]
            d["s"] += r["s"]
        pools: dict[str, dict[str, int]] = {}
        for r in rows:
            pools.setdefault(r["domain"], {}).setdefault(r["choral"]["pool"], 0)
            pools[r["domain"]][r["choral"]["pool"]] += 1
        return {"policy": policy, "wall_s": wall, "tokens": tokens, "tok_s": tokens / wall,
                "identical": sum(r["text"] == alone[r["id"]] for r in rows), "requests": len(rows), "pools": pools,
                "differ": [(r["id"], r["choral"]["pool"]) for r in rows if r["text"] != alone[r["id"]]],
                "domain_tok_s_per_request": {d: v["tokens"] / v["s"] for d, v in by_domain.items()}}  # fmt: skip

    rounds = []
    for rep in range(args.repeats):
        order = policies if rep % 2 == 0 else policies[::-1]
        for policy in order:
            r = one_round(policy)
            rounds.append(r | {"repeat": rep})
            print(f"round {rep} {policy}: {r['tokens']} tokens in {r['wall_s']:.1f} s = {r['tok_s']:.2f} tok/s, "
                  f"{r['identical']}/{r['requests']} identical, pools {r['pools']}", flush=True)  # fmt: skip
    summary = {p: statistics.median(r["tok_s"] for r in rounds if r["policy"] == p) for p in policies}
    identity = {p: sum(r["identical"] for r in rounds if r["policy"] == p) / sum(r["requests"] for r in rounds if r["policy"] == p)
                for p in policies}  # fmt: skip
    record = {"command": vars(args) | {"date": time.strftime("%Y-%m-%d")}, "prompts": len(prompts),
              "identity": identity, "rounds": rounds, "median_tok_s": summary}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "run.md").write_text(markdown(record))
    print(markdown(record))
    return 0


def faults(args: argparse.Namespace) -> int:
    """Kill one replica (the process listening on --kill's port, and its children) while
    --clients clients send the mixed requests through the front; tally what each request got,
    then send the requests again and check that they are served by the other pools."""
    import psutil

    prompts = prompts_for(args.domains, args.prompts_per_domain, args.offset)
    front = openai.OpenAI(base_url=f"{args.front}/v1", api_key=args.api_key, max_retries=0, timeout=args.timeout)
    model = front.models.list().data[0].id
    port = int(args.kill.rsplit(":", 1)[1])
    victim = next(c.pid for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port)

    def send(p: Prompt) -> dict:
        try:
            r = ask(front, model, p, args.max_tokens)
            return {"status": 200, "pool": r["choral"]["pool"], "s": r["s"]}
        except openai.APIStatusError as e:
            return {"status": e.status_code, "error": str(e)[:200]}
        except openai.APITimeoutError:
            return {"status": "hung"}

    with ThreadPoolExecutor(args.clients) as ex:
        futures = [ex.submit(send, p) for p in prompts]
        time.sleep(args.kill_after)
        proc = psutil.Process(victim)
        for child in [*proc.children(recursive=True), proc]:
            child.kill()
        killed_at = time.perf_counter()
        during = [f.result() for f in futures]
    settled_s = time.perf_counter() - killed_at  # the last request of the load answered, this long after the kill
    after = [send(p) for p in prompts[: args.clients]]
    tally = lambda rows: {str(k): sum(1 for r in rows if f"{r['status']}:{r.get('pool', '')}" == k)  # noqa: E731
                          for k in sorted({f"{r['status']}:{r.get('pool', '')}" for r in rows})}  # fmt: skip
    record = {"command": vars(args) | {"date": time.strftime("%Y-%m-%d")}, "killed_pid": victim,
              "during": tally(during), "after": tally(after), "errors": [r["error"] for r in during if "error" in r][:3],
              "load_answered_s_after_kill": settled_s}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 0


def markdown(record: dict) -> str:
    s = record["median_tok_s"]
    lines = [f"{record['prompts']} prompts ({', '.join(record['command']['domains'])}), {record['command']['max_tokens']} "
             f"tokens max, {record['command']['clients']} clients, median of {record['command']['repeats']} interleaved rounds",
             "", "| policy | tokens/s | vs routed |", "|---|---:|---:|"]  # fmt: skip
    for policy, v in s.items():
        lines.append(f"| {policy} | {v:.2f} | {v / s['routed']:.2f}x |")
    routed = [r for r in record["rounds"] if r["policy"] == "routed"]
    lines += ["", "Greedy outputs identical to vLLM's target alone (one request at a time): " + ", ".join(
        f"{k} {v:.0%}" for k, v in record["identity"].items()), f"Routed requests by domain and pool: {routed[0]['pools']}", ""]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="step", required=True)
    for name in ("profile", "run", "faults"):
        p = sub.add_parser(name)
        p.add_argument("--fleet", required=True)
        p.add_argument("--domains", type=lambda s: s.split(","), default=["code", "chat", "math", "edit"])
        p.add_argument("--prompts-per-domain", type=int, default=8)
        p.add_argument("--offset", type=int, default=0, help="first row of each domain (the router data starts at 100)")
        p.add_argument("--max-tokens", type=int, default=64)
        p.add_argument("--out", default="runs/vllm-fleet")
        if name == "profile":
            p.add_argument("--batch", type=int, default=8, help="requests at once for the target's batched step")
        if name in ("run", "faults"):
            p.add_argument("--front", required=True, help="base URL of serve --backend vllm")
            p.add_argument("--api-key", default="x")
            p.add_argument("--clients", type=int, default=8)
        if name == "run":
            p.add_argument("--repeats", type=int, default=2)
        if name == "faults":
            p.add_argument("--kill", required=True, help="the replica to kill: its base URL (this machine)")
            p.add_argument("--kill-after", type=float, default=10.0, help="seconds into the load")
            p.add_argument("--timeout", type=float, default=300.0, help="a request unanswered after this counts as hung")
    args = ap.parse_args(argv)
    return {"profile": profile, "run": run, "faults": faults}[args.step](args)


if __name__ == "__main__":
    raise SystemExit(main())
