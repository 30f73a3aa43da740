"""Compare train-draft runs of the same student: untrained vs each run's final and best step.

    python scripts/experiments/compare_drafts.py runs/draft-code-distill runs/draft-code-finetune --out runs/drafts-compare

Reads each run's ``metrics.json`` (nothing is re-measured: every number comes from the engine's
held-out evaluation inside ``train-draft``) and writes ``compare.md`` and ``compare.png``. The
untrained row is each run's step-0 evaluation; runs of the same student on the same prompts give
the same greedy acceptance there, which the table shows as a check.

    python scripts/experiments/compare_drafts.py runs/draft-code-distill runs/draft-code-finetune --measure 40 --draft-weights fp32

``--measure N`` re-measures instead, all students in one process on the same N held-out prompts of
the first run's domain: the untrained student (the first run's ``model.student``, cut to its
``student_layers`` if any, with the first run's draft vocabulary) and each run's ``final/`` checkpoint, greedy, with the engine of
``training/evaluate.py``. Written as ``measured.md`` and ``measured.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tqdm import tqdm

from serving.engine.engine_settings import EngineSettings
from serving.engine.models import load_model, load_tokenizer
from training.evaluate import held_out_prompts, measure
from training.students import derive_student, reduce_vocab


def rows_of(run: Path) -> tuple[dict, list[dict]]:
    metrics = json.loads((run / "metrics.json").read_text())
    cfg = metrics["config"]
    evals = [h for h in metrics["history"] if "acceptance_rate" in h]
    name = f"{cfg['loss']['kind']}" + (f" + {cfg['loss']['ce_ratio']} ce" if cfg["loss"]["kind"] != "ce" and cfg["loss"]["ce_ratio"] else "")
    return {"run": str(run), "loss": name, "metrics": metrics}, evals


def row(label: str, r: dict, alone: float, steps: str) -> str:
    ratio = r["draft_step_ms"] / r["target_step_ms"] if r.get("target_step_ms") else float("nan")
    return (f"| {label} | {steps} | {r['acceptance_rate']:.3f} | {r['tokens_per_target_call']:.2f} | "
            f"{r['tokens_per_second']:.2f} | {r['tokens_per_second'] / alone:.2f}x | {ratio:.3f} |")


def measure_runs(args, out: Path) -> int:
    """Untrained and every run's final student on the same held-out prompts, one target load."""
    first = json.loads((Path(args.runs[0]) / "metrics.json").read_text())["config"]
    tokenizer = load_tokenizer(first["model"]["target"])
    target = load_model(first["model"]["target"])
    prompts = held_out_prompts(first["data"]["domain"], args.measure, tokenizer)
    # As served: the target (and a copy of each student, in draft_weights) on Choral's CPU kernels.
    engine = EngineSettings(cpu_kernels=True, draft_weights=args.draft_weights, k=args.k, k_buckets=(args.k,))

    cut = first["model"].get("student_layers")  # a layer-cut student starts as the cut, untrained

    def untrained():
        student = load_model(first["model"]["student"])
        if cut:
            student = derive_student(student, cut)
        vocab = json.loads((Path(args.runs[0]) / "final" / "config.json").read_text()).get("draft_vocab")
        return reduce_vocab(student, vocab) if vocab else student

    base = first["model"]["student"] + (f" cut to {len(cut)} layers" if cut else "")
    students = [("untrained", base, untrained)]
    students += [(rows_of(Path(r))[0]["loss"] + " final", f"{r}/final", lambda r=r: load_model(f"{r}/final")) for r in args.runs]
    settings = dict(k=args.k, max_new_tokens=args.max_new_tokens, draft_weights=args.draft_weights)
    results = []
    for label, ref, build in tqdm(students, desc="students", unit="student"):
        r = measure(target, build(), tokenizer, prompts, engine, max_new_tokens=args.max_new_tokens)
        r.pop("token_ids")
        results.append({"student": label, "ref": ref} | r)
    lines = [f"Held-out greedy acceptance, {len(prompts)} {first['data']['domain']} evaluation prompts, "
             f"{args.max_new_tokens} new tokens, K={args.k}, draft weights {args.draft_weights}, one process. "
             f"Command: `python scripts/experiments/compare_drafts.py {' '.join(args.runs)} --measure {args.measure} "
             f"--draft-weights {args.draft_weights} --max-new-tokens {args.max_new_tokens} --k {args.k} --out {args.out}`", "",
             "| student | checkpoint | held-out acceptance | tokens / target call | draft / target step |", "|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['student']} | `{r['ref']}` | {r['acceptance_rate']:.3f} | {r['tokens_per_target_call']:.2f} | "
                     f"{r['draft_step_ms'] / r['target_step_ms']:.3f} |")
    md = "\n".join(lines) + "\n"
    (out / "measured.md").write_text(md)
    (out / "measured.json").write_text(json.dumps({"settings": settings | {"prompts": len(prompts)}, "results": results}, indent=1))
    print(md)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", help="train-draft output folders (with metrics.json)")
    ap.add_argument("--out", default="runs/drafts-compare")
    ap.add_argument("--measure", type=int, default=0, metavar="N", help="re-measure on N held-out prompts")
    ap.add_argument("--draft-weights", choices=["fp32", "int8"], default="int8", help="with --measure")
    ap.add_argument("--max-new-tokens", type=int, default=48, help="with --measure")
    ap.add_argument("--k", type=int, default=4, help="with --measure")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.measure:
        return measure_runs(args, out)

    lines = ["| student | steps | held-out acceptance | tokens / target call | tokens/s | vs target alone | draft / target step |",
             "|---|---|---|---|---|---|---|"]
    bars: list[tuple[str, float]] = []
    for i, path in enumerate(args.runs):
        info, evals = rows_of(Path(path))
        m = info["metrics"]
        alone = m["target_alone"]["tokens_per_second"]
        if i == 0:
            lines.append(row("untrained", m["before"], alone, "0"))
            bars.append(("untrained", m["before"]["acceptance_rate"]))
        else:
            lines.append(row(f"untrained (check, {path})", m["before"], alone, "0"))
        last = evals[-1]
        best = max(evals, key=lambda h: h["acceptance_rate"])
        lines.append(row(f"{info['loss']} final", last, alone, str(last.get("step", "?"))))
        lines.append(row(f"{info['loss']} best", best, alone, str(best.get("step", "?"))))
        bars.append((f"{info['loss']}\nfinal", last["acceptance_rate"]))
        minutes = m.get("train_seconds", 0) / 60
        lines.append(f"| ({path}: {m['step']} steps, {m['tokens']} tokens, {minutes:.1f} min of training) | | | | | | |")
    cfgs = [rows_of(Path(p))[0]["metrics"]["config"]["eval"] for p in args.runs]
    engine = cfgs[0].get("engine", cfgs[0])  # runs before the shared engine settings kept k and draft_weights in eval
    header = (f"Held-out greedy acceptance on the first {cfgs[0]['prompts']} evaluation prompts of the domain, "
              f"{cfgs[0]['max_new_tokens']} new tokens, K={engine['k']}, draft weights {engine.get('draft_weights', 'fp32')}; "
              "tokens/s are the evaluation's own (target alone measured in the same run).")
    md = "# train-draft runs compared\n\n" + header + "\n\n" + "\n".join(lines) + "\n"
    (out / "compare.md").write_text(md)

    import matplotlib  # only this mode plots; choosing a backend is no business of an import

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 * len(bars) + 2, 3.2))
    ax.bar([b[0] for b in bars], [b[1] for b in bars], color=["#999"] + ["#4a7"] * (len(bars) - 1))
    for x, (_, v) in enumerate(bars):
        ax.text(x, v + 0.01, f"{v:.3f}", ha="center")
    ax.set_ylabel("held-out acceptance")
    ax.set_ylim(0, 1)
    fig.tight_layout()
    fig.savefig(out / "compare.png", dpi=120)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
