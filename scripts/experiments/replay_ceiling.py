"""The ceiling of choosing a drafter per step (issue 62): per family, the best single drafter, the
per-prompt oracle over single drafters, and the per-step oracles, replayed on the target's own
greedy answers with measured step costs; live single-drafter runs check the replay.

    python scripts/experiments/replay_ceiling.py --per-family 5 --grounded 3 --out runs/replay-ceiling

1. One engine (the default precisions: q4 on the CPU kernels) with the target alone, ``ngram``,
   ``suffix``, ``prediction`` (grounded edits, with the code being edited as the prediction) and the
   0.5B draft at K = ``--k``.
2. Costs (``RowCosts``): the target's forward timed at each verify width and the draft's at widths
   1..128 (batch 1, after a 256-token prefill); each step's fixed host work (a target-alone
   decode's step time less its forward, measured then) is added to every verify width.
3. Per prompt: the target alone decodes the answer (timed: the baseline). Each host drafter is asked
   at every position for what it would propose (``serving.tools.drafting_replay``); the draft model
   reads the answer teacher-forced (its greedy chain from t is accepted as far as its argmax agrees
   with the answer, which is what its proposal would be). On every ``--live-every``-th prompt the
   single drafters also run live, timed, as the check on the replay.
4. Replay: each single drafter, the per-prompt oracle, the per-step greedy oracle (each step the
   drafter with the most tokens per ms) and the per-step best (dynamic programming: the bound).

Writes ``ceiling.json`` (command, date, machine, costs, every prompt's outcomes) and ``ceiling.md``.
Host drafters are asked at every position, one token observed at a time, so a stateful one
(``prediction``'s cursor) may propose slightly differently than in a live run; the live check shows
how far that goes.
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
HOSTS = ("ngram", "suffix", "prediction")


def timed(fn, reps: int) -> float:
    fn()  # warm
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def forward_ms(runner, width: int, at: int, reps: int) -> float:
    import torch

    tokens = torch.zeros(1, width, dtype=torch.long)
    positions = torch.arange(at, at + width).unsqueeze(0)  # [1, W]
    return timed(lambda: runner.forward(tokens, positions, last_only=True), reps)


def host_trace(drafter, prompt: list[int], prediction, answer: list[int], k: int, request_id: int):
    """What ``drafter`` proposes at each position t of the answer, and how much of it matches."""
    from serving.engine.drafters.base import RowContext

    T = len(answer)
    proposed, accepted, spent = [0] * T, [0] * T, 0.0
    drafter.start(0, RowContext(request_id, prompt, prediction, False))
    drafter.observe(0, answer[:1])  # the prefill's token
    history = list(prompt) + answer[:1]
    for t in range(1, T):
        t0 = time.perf_counter()
        proposal = drafter.propose(0, history, drafter.k or k)
        spent += time.perf_counter() - t0
        n = 0
        while n < len(proposal) and t + n < T and proposal[n] == answer[t + n]:
            n += 1
        proposed[t], accepted[t] = len(proposal), n
        drafter.observe(0, answer[t : t + 1])
        history.append(answer[t])
    drafter.stop(0, True)
    return proposed, accepted, 1e3 * spent / max(T - 1, 1)


def model_trace(runner, prompt: list[int], answer: list[int], k: int, chunk: int):
    """The draft's greedy agreement with the answer, teacher-forced: accepted[t] = how many of its
    chain of k from position t match (its j-th draft only matters while the earlier ones matched,
    and then it read exactly the answer's tokens). Also its prefill's ms."""
    import torch

    t0 = time.perf_counter()
    first = runner.prefill(torch.tensor([prompt]), 0).argmax(-1).item()  # predicts answer[0]
    prefill_ms = 1e3 * (time.perf_counter() - t0)
    T, L, agree = len(answer), len(prompt), [first == answer[0]]
    for s in range(0, T - 1, chunk):  # answer[s : s + chunk] at positions L + s ..., predicting answer[s + 1 ...]
        piece = answer[s : min(s + chunk, T - 1)]
        logits = runner.forward(torch.tensor([piece]), torch.arange(L + s, L + s + len(piece)).unsqueeze(0))  # [1, W, V]
        agree += (logits[0].argmax(-1) == torch.tensor(answer[s + 1 : s + 1 + len(piece)])).tolist()
    accepted = [0] * T
    for t in range(1, T):
        n = 0
        while n < k and t + n < T and agree[t + n]:
            n += 1
        accepted[t] = n
    return [k] * T, accepted, prefill_ms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=TARGET, help="the target (default: the bundled 1.5B)")
    ap.add_argument("--draft", default=DRAFT, help="the draft model (default: the bundled 0.5B)")
    ap.add_argument("--split", default="test", help="the workload split (test: held out; val: for tuning a policy)")
    ap.add_argument("--per-family", type=int, default=5, help="prompts per workload family")
    ap.add_argument("--grounded", type=int, default=3, help="prompts per grounded domain (edit, extract, summarize, quoted)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--live-every", type=int, default=2, help="run the single drafters live on every n-th prompt (0: never)")
    ap.add_argument("--reps", type=int, default=9, help="repetitions of each timed forward")
    ap.add_argument("--out", default="runs/replay-ceiling")
    args = ap.parse_args(argv)

    import torch

    from serving.engine import Request
    from serving.engine.devices import describe_machine
    from serving.engine.engine_settings import EngineSettings
    from serving.engine.loader import load_engine
    from serving.engine.goodput import RowCosts
    from serving.prompts import encode_prompt, load_grounded
    from serving.tools.drafting_replay import Replay, Trace
    from serving.workload import FAMILIES, load_workload

    settings = EngineSettings(device="cpu", max_len=2048, k=args.k)
    loaded = load_engine(settings, args.target, {"none": None, "ngram": "ngram", "suffix": "suffix", "draft": args.draft})
    engine, tok = loaded.engine, loaded.tokenizer
    widths = list(engine.verify_widths())  # a host drafter's own k may verify wider than K + 1
    target_runner, draft_runner = engine.verifier.runner, engine.drafters["draft"].runner

    prompts = [(p.domain, p.id, encode_prompt(tok, p), None) for p in load_workload(args.split, args.per_family)]
    for domain in ("edit", "extract", "summarize", "quoted"):
        for g in load_grounded(domain, args.grounded):
            prediction = tok.encode(g.source, add_special_tokens=False) if domain == "edit" else None
            prompts.append((f"grounded-{domain}", g.prompt.id, encode_prompt(tok, g.prompt), prediction))

    # 2. Forward costs, batch 1, after a 256-token prompt in the row (any ids: a tiny test model has few).
    filler = [i % target_runner.model.config.vocab_size for i in range(1000, 1256)]
    engine.generate([Request(filler, max_new_tokens=2, drafter="none")])  # warm
    target_runner.prefill(torch.tensor([filler]), 0)
    draft_runner.prefill(torch.tensor([filler]), 0)
    verify_fwd = {w: forward_ms(target_runner, w, 256, args.reps) for w in widths}
    # The step's fixed host work (sampling, acceptance, bookkeeping): a target-alone decode's step
    # time less its forward, measured now, on the quiet machine, rather than from the live runs.
    calibration = []
    for _ in range(3):
        [done] = engine.generate([Request(filler, max_new_tokens=33, drafter="none")])
        calibration.append(1e3 * (done.stats["total_time_s"] - done.stats["prefill_time_s"]) / done.stats["target_calls"])
    overhead = max(statistics.median(calibration) - verify_fwd[1], 0.0)
    draft_fwd = {w: forward_ms(draft_runner, w, 256, args.reps) for w in (1, 2, 3, 4, 5, 8, 16, 32, 64, 128)}
    print(f"target forward ms by width: {verify_fwd}, plus {overhead:.1f} ms a step\ndraft forward ms by width: {draft_fwd}",
          file=sys.stderr, flush=True)  # fmt: skip

    rows, replay_hosts = [], {}
    for i, (family, pid, prompt, prediction) in enumerate(prompts):
        drafters = ["none", "ngram", "suffix", "draft"] + (["prediction"] if prediction else [])
        live = {}
        order = drafters if args.live_every and i % args.live_every == 0 else ["none"]
        order = order[i % len(order):] + order[: i % len(order)]  # rotate, so drift hits every drafter alike
        answer = None
        for name in order:
            t0 = time.perf_counter()
            [out] = engine.generate([Request(prompt, max_new_tokens=args.max_tokens, drafter=name, prediction=prediction)])
            live[name] = {"ms": 1e3 * (time.perf_counter() - t0), "steps": out.stats["target_calls"],
                          "prefill_ms": 1e3 * out.stats["prefill_time_s"], "accepted": out.stats["accepted"],
                          "drafted": out.stats["drafted"]}  # fmt: skip
            if answer is not None and list(out.token_ids) != answer:
                raise SystemExit(f"{pid}: {name}'s greedy output differs from the target alone's: the replay assumes it cannot")
            answer = list(out.token_ids)
        proposed, accepted, host_ms = {}, {}, {}
        for name in drafters[1:]:
            if name == "draft":
                proposed[name], accepted[name], draft_prefill = model_trace(draft_runner, prompt, answer, args.k, chunk=max(widths))
            else:
                drafter = replay_hosts.setdefault(name, settings.host_drafter(name))  # not the engine's: its suffix cache saw the live runs
                proposed[name], accepted[name], host_ms[name] = host_trace(drafter, prompt, prediction, answer, args.k, 10**9 + i)
        prefill_ms = live["none"]["prefill_ms"]
        rows.append({"family": family, "id": pid, "prompt_tokens": len(prompt), "answer_tokens": len(answer),
                     "live": live, "prefill_ms": prefill_ms, "draft_prefill_ms": draft_prefill, "host_ms": host_ms,
                     "proposed": proposed, "accepted": accepted})  # fmt: skip
        print(f"[{i + 1}/{len(prompts)}] {family} {pid}: {len(answer)} tokens, live " +
              ", ".join(f"{n} {v['ms'] / 1e3:.1f}s" for n, v in live.items()), file=sys.stderr, flush=True)  # fmt: skip

    host_cost = {n: statistics.fmean([r["host_ms"][n] for r in rows if n in r["host_ms"]]) for n in HOSTS
                 if any(n in r["host_ms"] for r in rows)}  # fmt: skip
    costs = RowCosts(verify=[[w, ms + overhead] for w, ms in verify_fwd.items()], model={"draft": [[w, ms] for w, ms in draft_fwd.items()]},
                     host=host_cost)  # fmt: skip

    policies = ["none", "ngram", "suffix", "draft", "prediction"]
    for r in rows:
        trace = Trace(r["answer_tokens"], r["proposed"], r["accepted"], prefill_ms=r["prefill_ms"],
                      model_prefill_ms={"draft": r["draft_prefill_ms"]})  # fmt: skip
        replay = Replay(trace, costs, widths, args.k)
        out = {p: replay.single(None if p == "none" else p) for p in policies if p == "none" or p in r["proposed"]}
        out["per-step greedy"], out["per-step best"] = replay.per_step_greedy(), replay.per_step_best()
        r["replay_ms"] = {p: o.ms for p, o in out.items()}
        r["replay_steps"] = {p: o.steps for p, o in out.items()}
        r["choices"] = {p: o.choices for p, o in out.items() if p.startswith("per-step")}

    def speedups(group: list[dict], policy: str) -> list[float]:
        return [r["replay_ms"]["none"] / r["replay_ms"][policy] for r in group]

    groups = {f: [r for r in rows if r["family"] == f] for f in [*FAMILIES, *sorted({r["family"] for r in rows} - set(FAMILIES))]}
    groups = {f: g for f, g in groups.items() if g}
    groups["workload (six families)"] = [r for r in rows if r["family"] in FAMILIES]
    singles = ["ngram", "suffix", "draft"]
    lines = ["| prompts | n | " + " | ".join(singles) + " | prediction | best single | per-prompt oracle | per-step greedy | "
             "per-step best | best / best single |", "|---|---|" + "---|" * (len(singles) + 6)]  # fmt: skip
    summary = {}
    for name, g in groups.items():
        mean = {p: statistics.fmean(speedups(g, p)) for p in singles}
        pred = [r for r in g if "prediction" in r["replay_ms"]]
        best_single = max(mean, key=mean.get)
        oracle = statistics.fmean(max(r["replay_ms"]["none"] / r["replay_ms"][p] for p in r["replay_ms"] if not p.startswith("per-step"))
                                  for r in g)  # fmt: skip
        greedy, best = statistics.fmean(speedups(g, "per-step greedy")), statistics.fmean(speedups(g, "per-step best"))
        summary[name] = {"n": len(g), **mean, "best_single": best_single, "per_prompt_oracle": oracle, "per_step_greedy": greedy,
                         "per_step_best": best, "ratio": best / mean[best_single]}  # fmt: skip
        lines.append(f"| {name} | {len(g)} | " + " | ".join(f"{mean[p]:.2f}x" for p in singles) +
                     (f" | {statistics.fmean(speedups(pred, 'prediction')):.2f}x" if pred else " | -") +
                     f" | {best_single} {mean[best_single]:.2f}x | {oracle:.2f}x | {greedy:.2f}x | {best:.2f}x | "
                     f"**{best / mean[best_single]:.3f}** |")  # fmt: skip

    # The check: live single-drafter speedups against the replay's, on the prompts run live.
    check = ["", "| drafter | prompts run live | live speedup | replayed speedup | live tokens per call | replayed |", "|---|---|---|---|---|---|"]
    for p in ["ngram", "suffix", "draft", "prediction"]:
        both = [r for r in rows if p in r["live"] and p in r["replay_ms"]]
        if not both:
            continue
        live = statistics.fmean(r["live"]["none"]["ms"] / r["live"][p]["ms"] for r in both)
        rep = statistics.fmean(r["replay_ms"]["none"] / r["replay_ms"][p] for r in both)
        live_tpc = statistics.fmean((r["answer_tokens"] - 1) / r["live"][p]["steps"] for r in both)
        rep_tpc = statistics.fmean((r["answer_tokens"] - 1) / r["replay_steps"][p] for r in both)
        check.append(f"| {p} | {len(both)} | {live:.2f}x | {rep:.2f}x | {live_tpc:.2f} | {rep_tpc:.2f} |")
    share = {}
    for r in groups["workload (six families)"]:
        for d, n in r["choices"]["per-step best"].items():
            share[d] = share.get(d, 0) + n
    total = sum(share.values()) or 1
    shares = "per-step best's steps on the workload: " + ", ".join(f"{d} {n / total:.0%}" for d, n in sorted(share.items(), key=lambda x: -x[1]))

    command = " ".join(["python scripts/experiments/replay_ceiling.py", *(argv if argv is not None else sys.argv[1:])])
    head = [f"`{command}` ({datetime.date.today()}, {describe_machine(with_threads=True)}); q4 target and draft, K = {args.k}, greedy, "
            f"{args.max_tokens} tokens; speedups over the target alone, replayed with the measured costs below "
            "(means over prompts).", "",
            f"Costs (ms, batch 1): target forward by width {json.dumps({w: round(v, 1) for w, v in verify_fwd.items()})} plus "
            f"{overhead:.1f} ms of step work; draft forward by width {json.dumps({w: round(v, 1) for w, v in draft_fwd.items()})}; "
            f"host proposals {json.dumps({n: round(v, 3) for n, v in host_cost.items()})}.", ""]  # fmt: skip
    text = "\n".join(head + lines + check + ["", shares]) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ceiling.json").write_text(json.dumps({"command": command, "date": str(datetime.date.today()), "machine": describe_machine(with_threads=True),
                                                  "costs": {"verify": costs.verify, "model": costs.model, "host": costs.host},
                                                  "summary": summary, "rows": rows}))  # fmt: skip
    (out / "ceiling.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
