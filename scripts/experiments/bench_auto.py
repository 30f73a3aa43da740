"""``auto`` live against every single drafter (issue 62), and the replay of its policy.

    python scripts/experiments/bench_auto.py --per-family 4 --grounded 3 --max-tokens 64 --repeats 3 --out runs/bench-auto

1. One engine (the default precisions: q4 on the CPU kernels) holding ``ngram``, ``suffix``, the
   0.5B draft, ``prediction`` (grounded edits carry the code being edited) and ``auto`` over them.
2. Each held-out (test split) prompt of the six families, and the grounded edits, decoded greedily
   by the target alone and by each drafter, order rotated per prompt and repeat, timed end to end
   (prefill included). Every output is checked against the target alone's. Medians over repeats.
3. The host work of ``auto`` (its host proposals, choices and scoring, ``AutoDrafter.host_s``)
   against the steps' time at batch 8: eight ``auto`` requests at once.
4. ``auto``'s policy replayed (``Replay.policy``) over the traces of ``--traces`` (a
   ``replay_ceiling.py`` output), beside the per-step oracle, cut at ``--max-tokens``; also with
   each prompt's own acceptance as its prior (a perfect router: an upper bound on what a learned
   prior can give). ``--replay-only --grid`` tunes the settings on a val split's traces:

    python scripts/experiments/bench_auto.py --replay-only --grid --traces runs/replay-val/ceiling.json --max-tokens 128 --out runs/auto-val

Writes ``auto.json`` and ``auto.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
DRAFTERS = ("none", "ngram", "suffix", "draft", "auto")


def load(args):
    from serving.engine.engine_settings import EngineSettings
    from serving.engine.loader import load_engine

    settings = EngineSettings(device="cpu", max_len=args.max_len, k=args.k, max_batch_size=args.batch)
    refs = {"none": None, "ngram": "ngram", "suffix": "suffix", "draft": args.draft, "auto": "auto"}
    return load_engine(settings, args.target, refs)


def prompts_of(tok, args) -> list[tuple[str, str, list[int], list[int] | None]]:
    from serving.prompts import encode_prompt, load_grounded
    from serving.workload import load_workload

    out = [(p.domain, p.id, encode_prompt(tok, p), None) for p in load_workload("test", args.per_family)]
    for g in load_grounded("edit", args.grounded):
        out.append(("grounded-edit", g.prompt.id, encode_prompt(tok, g.prompt), tok.encode(g.source, add_special_tokens=False)))
    return out


def live(engine, prompts, args) -> list[dict]:
    """Every run starts from the same ``suffix`` cross-request cache: the answers of the prompts
    before this one (as in a server that has seen them), never this prompt's own answer from an
    earlier run or repeat (which would turn ``suffix`` and ``auto`` into copies of the answer)."""
    import copy

    from serving.engine import Request

    suffix = engine.drafters["suffix"]  # auto drafts with this same instance
    warm = copy.deepcopy(suffix.cache)
    rows = []
    for i, (family, pid, prompt, prediction) in enumerate(prompts):
        names = [*DRAFTERS, *(["prediction"] if prediction else [])]
        ms: dict[str, list[float]] = {n: [] for n in names}
        stats: dict[str, dict] = {}
        answer = None
        for rep in range(args.repeats):
            shift = (i + rep) % len(names)
            for name in names[shift:] + names[:shift]:  # rotated: drift hits every drafter alike
                suffix.cache = copy.deepcopy(warm)
                t0 = time.perf_counter()
                [out] = engine.generate([Request(prompt, max_new_tokens=args.max_tokens, drafter=name, prediction=prediction)])
                ms[name].append(1e3 * (time.perf_counter() - t0))
                if answer is not None and list(out.token_ids) != answer:
                    raise SystemExit(f"{pid}: {name}'s greedy output differs from the others'")
                answer = list(out.token_ids)
                stats[name] = {"tokens_per_call": out.stats["mean_accepted_length"], "shares": out.stats["drafter_shares"]}
        warm.start_request(("answer", i), prompt)  # this prompt's answer joins the cache for the next ones
        warm.add_tokens(("answer", i), answer)
        warm.stop_request(("answer", i))
        med = {n: statistics.median(v) for n, v in ms.items()}
        rows.append({"family": family, "id": pid, "tokens": len(answer), "ms": ms, "median_ms": med, "stats": stats,
                     "speedup": {n: med["none"] / med[n] for n in names}})  # fmt: skip
        print(f"[{i + 1}/{len(prompts)}] {family} {pid}: " + ", ".join(
            f"{n} {rows[-1]['speedup'][n]:.2f}x ({stats[n]['tokens_per_call']:.2f}/call)" for n in names), file=sys.stderr, flush=True)
    return rows


def host_share(engine, prompts, args) -> dict:
    """Eight auto requests at once: auto's host time against the steps' time."""
    from serving.engine import Request

    auto = engine.drafters["auto"]
    batch = [Request(p, max_new_tokens=args.max_tokens, drafter="auto", prediction=pred) for _, _, p, pred in prompts[: args.batch]]
    steps, step_s = 0, 0.0
    for r in batch:
        engine.add_request(r)
    engine.step()  # admits all of them (their prefills are not the steps' work)
    auto.host_s = 0.0
    while engine.has_unfinished_requests() and engine.num_running == len(batch):  # the full batch only
        t0 = time.perf_counter()
        engine.step()
        step_s += time.perf_counter() - t0
        steps += 1
    before = auto.host_s
    while engine.has_unfinished_requests():
        engine.step()
    auto.host_s = before
    return {"rows": len(batch), "steps": steps, "step_ms": 1e3 * step_s / steps, "host_ms_per_step": 1e3 * auto.host_s / steps,
            "share": auto.host_s / step_s}  # fmt: skip


def own_priors(r: dict) -> dict[str, float]:
    """A prompt's own per-token acceptance by record key (``draft``, ``suffix@3``, ...): what a
    perfect router could tell ``auto`` before the request starts (no router knows this much)."""
    from serving.engine.drafters.auto import host_key

    hits: dict[str, int] = {}
    trials: dict[str, int] = {}
    for name, proposed in r["proposed"].items():
        for t, n in enumerate(proposed):
            if t == 0 or not n:
                continue
            key, a = (name if name == "draft" else host_key(name, n)), r["accepted"][name][t]
            hits[key] = hits.get(key, 0) + a
            trials[key] = trials.get(key, 0) + min(a + 1, n)
    return {k: hits[k] / trials[k] for k in hits}


def replayed(path: str, max_tokens: int, options: dict, perfect_weight: float = 8.0) -> dict:
    """Per family: each single drafter, ``auto``'s policy (``options``), the same policy with each
    prompt's own acceptance as its prior (``perfect_weight`` pseudo-tokens), and the per-step bound."""
    from serving.engine.drafters.auto import HybridPolicy
    from serving.engine.goodput import RowCosts
    from serving.tools.drafting_replay import Replay, Trace

    data = json.loads(Path(path).read_text())
    c = data["costs"]
    costs = RowCosts(verify=c["verify"], model=c["model"], host=c["host"])
    widths = tuple(w for w, _ in c["verify"])
    out: dict[str, list[dict]] = {}
    for r in data["rows"]:
        n = min(max_tokens, r["answer_tokens"])
        accepted = {d: [min(a, n - 1 - t) for t, a in enumerate(v[:n])] for d, v in r["accepted"].items()}
        trace = Trace(n, {d: v[:n] for d, v in r["proposed"].items()}, accepted, prefill_ms=r["prefill_ms"],
                      model_prefill_ms={"draft": r["draft_prefill_ms"]})  # fmt: skip
        replay = Replay(trace, costs, widths, 4)
        base = replay.single(None).ms
        perfect = {**options, "prior_a": {**options.get("prior_a", {}), **own_priors(r)}, "prior_weight": perfect_weight}
        row = {d: base / replay.single(d).ms for d in ("ngram", "suffix", "draft") if d in r["proposed"]}
        row |= {"auto": base / replay.policy(HybridPolicy(costs, widths, **options)).ms,
                "auto, perfect prior": base / replay.policy(HybridPolicy(costs, widths, **perfect)).ms,
                "per-step best": base / replay.per_step_best().ms}  # fmt: skip
        out.setdefault(r["family"], []).append(row)
    return out


def grid(path: str, max_tokens: int, base: dict) -> list[tuple[float, dict]]:
    """``auto``'s workload mean over a small grid of its settings, best first (tune on val traces)."""
    import itertools

    from serving.workload import FAMILIES

    results = []
    for lengths, model, weight, catch_up in itertools.product((False, True), (0.5, 0.7, 0.85), (2.0, 4.0, 8.0), (0.0, 0.5, 1.0)):
        prior = {**(base["prior_a"] if lengths else {}), "draft": model}
        options = {**base, "prior_a": prior, "prior_weight": weight, "catch_up_weight": catch_up}
        rows = [x for f, g in replayed(path, max_tokens, options).items() if f in FAMILIES for x in g]
        results.append((statistics.fmean(x["auto"] for x in rows), {"length_priors": lengths, "draft_prior": model,
                                                                      "prior_weight": weight, "catch_up_weight": catch_up}))  # fmt: skip
    return sorted(results, key=lambda x: -x[0])


def table(groups: dict[str, list[dict]], columns: list[str]) -> list[str]:
    lines = ["| prompts | n | " + " | ".join(columns) + " | best single | auto / best single |",
             "|---|---|" + "---|" * (len(columns) + 2)]  # fmt: skip
    for name, g in groups.items():
        mean = {c: statistics.fmean(r[c] for r in g if c in r) for c in columns if any(c in r for r in g)}
        singles = {c: v for c, v in mean.items() if c not in ("none", "per-step best") and not c.startswith("auto")}
        best = max(singles, key=singles.get)
        lines.append(f"| {name} | {len(g)} | " + " | ".join(f"{mean[c]:.2f}x" if c in mean else "-" for c in columns) +
                     f" | {best} {singles[best]:.2f}x | **{mean['auto'] / singles[best]:.3f}** |")  # fmt: skip
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft", default=DRAFT)
    ap.add_argument("--per-family", type=int, default=4, help="held-out (test split) prompts per workload family")
    ap.add_argument("--grounded", type=int, default=3, help="grounded code edits (with the code as the prediction)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8, help="the batch of the host-work measurement")
    ap.add_argument("--traces", default="runs/replay-ceiling/ceiling.json", help="replay_ceiling.py's output ('' to skip)")
    ap.add_argument("--replay-only", action="store_true", help="no live runs: replay the traces only")
    ap.add_argument("--grid", action="store_true", help="also replay a small grid of auto's settings (tune on val traces)")
    ap.add_argument("--out", default="runs/bench-auto")
    args = ap.parse_args(argv)

    from serving.engine.devices import describe_machine
    from serving.engine.engine_settings import EngineSettings
    from serving.workload import FAMILIES

    a = EngineSettings().auto
    options = {"prior_a": dict(a.prior_a), "default_prior": a.default_prior, "prior_weight": a.prior_weight,
               "catch_up_weight": a.catch_up_weight}  # fmt: skip
    lines, rows, host = [], [], None
    if not args.replay_only:
        loaded = load(args)
        engine, tok = loaded.engine, loaded.tokenizer
        prompts = prompts_of(tok, args)
        rows = live(engine, prompts, args)
        host = host_share(engine, prompts, args)
        groups = {f: [r["speedup"] for r in rows if r["family"] == f] for f in [*FAMILIES, "grounded-edit"]}
        groups = {f: g for f, g in groups.items() if g}
        groups["workload (six families)"] = [r["speedup"] for r in rows if r["family"] in FAMILIES]
        lines = ["Live (medians of repeats; speedup over the target alone, means over prompts):", "",
                 *table(groups, ["ngram", "suffix", "draft", "prediction", "auto"])]  # fmt: skip
        share: dict[str, float] = {}
        for r in rows:
            if r["family"] in FAMILIES:
                for d, v in r["stats"]["auto"]["shares"].items():
                    share[d] = share.get(d, 0.0) + v / len(groups["workload (six families)"])
        lines += ["", "auto's steps on the workload: " + ", ".join(f"{d} {v:.0%}" for d, v in sorted(share.items(), key=lambda x: -x[1])),
                  "", f"Host work of auto at batch {host['rows']}: {host['host_ms_per_step']:.2f} ms per step of "
                  f"{host['step_ms']:.1f} ms ({100 * host['share']:.2f}%)."]  # fmt: skip
    replay = replayed(args.traces, args.max_tokens, options) if args.traces and Path(args.traces).exists() else {}
    if replay:
        groups = dict(replay)
        groups["workload (six families)"] = [r for f in FAMILIES for r in replay.get(f, [])]
        lines += ["", f"Replayed over {args.traces} (cut at {args.max_tokens} tokens, its own costs):", "",
                  *table(groups, ["ngram", "suffix", "draft", "auto", "auto, perfect prior", "per-step best"])]  # fmt: skip
    if args.grid and replay:
        top = grid(args.traces, args.max_tokens, options)
        lines += ["", "auto's settings on these traces, best five of the grid (workload mean):", "",
                  *[f"- {mean:.3f}x: {json.dumps(setting)}" for mean, setting in top[:5]]]  # fmt: skip
    command = " ".join(["python scripts/experiments/bench_auto.py", *(argv if argv is not None else sys.argv[1:])])
    text = "\n".join([f"`{command}` ({datetime.date.today()}, {describe_machine(with_threads=True)})", "", *lines]) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "auto.json").write_text(json.dumps({"command": command, "date": str(datetime.date.today()), "machine": describe_machine(with_threads=True),
                                               "rows": rows, "host": host, "replay": replay}))  # fmt: skip
    (out / "auto.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
