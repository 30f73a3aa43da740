"""The benchmark report: every number the README quotes, from saved runs or measured afresh.

    python scripts/report.py --router runs/main/router/router.pt --out runs/report     # measure routed
    python scripts/report.py --routed-json runs/report/routed.json --out runs/report   # re-render

Sections (each from the file named, skipped with a note when the file is missing):

* workload: the six-family workload's test split, per family: the target alone, every single
  drafter, the routed policy (drafter and K per prompt) and the per-prompt oracle, measured live
  (``--workload-router``; saved as ``workload.json``, re-rendered with ``--workload-json``);
* routed: per domain, the target alone, Hugging Face assisted generation with the bundled 0.5B,
  Choral with the generic 0.5B draft and Choral with the router's draft per prompt, interleaved
  prompt by prompt on the same spec-bench prompts (``--router``; saved as ``routed.json``);
* engine: ``spec-bench``'s tables and K sweep (``--bench``, a bench.json);
* router: ``train-router``'s held-out evaluation (``eval.json`` next to ``router.pt``);
* server: ``scripts/load_test.py`` results (``--load-test``, JSON files);
* main job: stage timings and answers (``--main-job``, main_job.json).

Writes ``report.md`` and ``routed.png`` under ``--out``; ``--page docs/results.md`` also writes the
report as the docs' results page, headed by the command, the date and the machine it ran on.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from routing import Router
from serving.engine.devices import describe_machine
from serving.engine.engine_settings import EngineSettings
from serving.engine.loader import build_engine, prepare_kernels
from serving.engine.models import check_same_tokenizer, load_model, load_tokenizer
from serving.prompts import DOMAINS, encode_prompt, load_prompts
from serving.tools.bench import bench_prompt, run_engine, summarize

GENERIC = "qwen2.5-coder-0.5b-instruct"


def measure_routed(args) -> dict:
    """Target alone, routed Choral and HF assisted (generic draft) through spec-bench's own
    ``bench_prompt`` (interleaved, rotating order), plus Choral with the generic draft."""
    router = Router.load(args.router)
    tokenizer = load_tokenizer(router.target_ref)
    target = load_model(router.target_ref)
    refs = {name: ref for name, ref in router.draft_refs.items() if ref is not None}
    if GENERIC not in refs.values():
        refs["generic"] = GENERIC
    models, by_ref = {}, {}
    for name, ref in refs.items():
        if ref not in by_ref:  # one copy per model, however many names point at it
            check_same_tokenizer(tokenizer, load_tokenizer(ref), draft_name=f"draft {name!r}")
            by_ref[ref] = load_model(ref)
        models[name] = by_ref[ref]
    generic_name = next(n for n, r in refs.items() if r == GENERIC)
    k_max = args.k
    settings = EngineSettings(device="cpu", k=k_max, k_buckets=tuple(range(1, k_max + 1)), draft_confidence=args.draft_confidence,
                              draft_weights=args.draft_weights)  # fmt: skip
    widths = settings.engine_config(draft=True, k="auto").step_widths
    # HF assisted generation runs its users' setup: the generic draft in fp32 on stock kernels.
    hf_draft = models[generic_name] if args.draft_weights == "fp32" else load_model(GENERIC)
    prepare_kernels(settings, [target], list(by_ref.values()), widths)
    target_engine = build_engine(settings, tokenizer, target, k_buckets=(1,))
    engines = {name: build_engine(settings, tokenizer, target, {"draft": m}) for name, m in models.items()}
    engines["none"] = target_engine
    eos = sorted(target_engine._eos)
    prompts = {d: load_prompts(d, args.prompts_per_domain) for d in DOMAINS}
    report = {"config": {"router": args.router, "k": args.k, "draft_weights": args.draft_weights, "draft_confidence": args.draft_confidence,
                         "prompts_per_domain": args.prompts_per_domain, "max_new_tokens": args.max_new_tokens,
                         "machine": f"{platform.machine()} {os.cpu_count()} cpus, {torch.get_num_threads()} threads",
                         "command": " ".join(["python scripts/report.py", *sys.argv[1:]])},  # fmt: skip
              "rows": {}, "summary": {}}  # fmt: skip
    warm = encode_prompt(tokenizer, prompts["code"][0])
    for engine in engines.values():
        run_engine(engine, warm, 4)
    with tqdm(total=sum(map(len, prompts.values())), desc="routed bench", unit="prompt") as bar:
        for d, rows in prompts.items():
            out = []
            for i, prompt in enumerate(prompts[d]):
                ids = encode_prompt(tokenizer, prompt)
                choice = router.choose(prompt.text)
                row = bench_prompt((target_engine, engines[choice.draft]), (target, hf_draft),
                                   ids, args.max_new_tokens, eos, i, True)  # fmt: skip
                generic_ids, s = run_engine(engines[generic_name], ids, args.max_new_tokens)
                row |= {"id": prompt.id, "draft": choice.draft, "generic_tokens": len(generic_ids),
                        "generic_s": s["total_time_s"], "generic_identical": generic_ids == row["target_ids"]}  # fmt: skip
                out.append(row)
                bar.update(1)
                bar.set_postfix(domain=d, draft=choice.draft)
            report["rows"][d] = out
    for d, rows in list(report["rows"].items()) + [("all", [r for rows in report["rows"].values() for r in rows])]:
        s = summarize(rows)
        generic_tps = sum(r["generic_tokens"] for r in rows) / sum(r["generic_s"] for r in rows)
        choices: dict[str, int] = {}
        for r in rows:
            choices[r["draft"]] = choices.get(r["draft"], 0) + 1
        report["summary"][d] = s | {"generic_tokens_per_s": generic_tps, "generic_identical": sum(r["generic_identical"] for r in rows),
                                    "routed_vs_hf": s["choral_tokens_per_s"] / s["hf_tokens_per_s"], "choices": choices}  # fmt: skip
    return report


def routed_markdown(r: dict) -> str:
    c = r["config"]
    lines = [f"Routed drafts vs Hugging Face assisted generation (bundled 0.5B), `{c['command']}` on {c['machine']}: "
             f"greedy, {c['max_new_tokens']} new tokens, {c['prompts_per_domain']} prompts per domain, K = {c['k']}"
             + (f", draft-confidence {c['draft_confidence']}" if c["draft_confidence"] else "") + ".", "",
             "| domain | target alone tok/s | HF assisted (0.5B) tok/s | Choral generic 0.5B tok/s | Choral routed tok/s | "
             "routed / target | routed / HF | routed acceptance | tokens / target call | drafts chosen | identical to target |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for d, s in r["summary"].items():
        chosen = ", ".join(f"{k} {v}" for k, v in sorted(s["choices"].items()))
        lines.append(f"| {d} | {s['target_tokens_per_s']:.2f} | {s['hf_tokens_per_s']:.2f} | {s['generic_tokens_per_s']:.2f} | "
                     f"{s['choral_tokens_per_s']:.2f} | {s['choral_speedup']:.2f}x | {s['routed_vs_hf']:.2f}x | "
                     f"{s['acceptance_rate']:.2f} | {s['tokens_per_target_call']:.2f} | {chosen} | "
                     f"{s['choral_identical']}/{s['prompts']} routed, {s['generic_identical']}/{s['prompts']} generic, "
                     f"{s['hf_identical']}/{s['prompts']} HF |")  # fmt: skip
    return "\n".join(lines) + "\n"


def routed_plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = list(r["summary"])
    series = [("target alone", "target_tokens_per_s"), ("HF assisted 0.5B", "hf_tokens_per_s"),
              ("Choral generic 0.5B", "generic_tokens_per_s"), ("Choral routed", "choral_tokens_per_s")]  # fmt: skip
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(series)
    for i, (label, key) in enumerate(series):
        ax.bar([x + i * width for x in range(len(domains))], [r["summary"][d][key] for d in domains], width, label=label)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(domains))], domains)
    ax.set_ylabel("tokens/s (greedy, identical outputs)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def section(title: str, path: str | None, render) -> str:
    if not path or not Path(path).exists():
        return f"## {title}\n\n(not available: {path or 'no file given'})\n\n"
    return f"## {title}\n\nFrom `{path}`.\n\n{render(path)}\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--router", help="router.pt: measure the routed bench now")
    ap.add_argument("--routed-json", help="re-render a saved routed.json instead of measuring")
    ap.add_argument("--prompts-per-domain", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--draft-confidence", type=float, default=0.4)
    ap.add_argument("--draft-weights", choices=["fp32", "int8"], default="fp32",
                    help="Choral's drafts in fp32 or W8A8 int8 (HF assisted keeps the fp32 generic draft)")
    ap.add_argument("--workload-router", help="router.pt: measure the workload section now")
    ap.add_argument("--workload-json", help="re-render a saved workload.json instead of measuring")
    ap.add_argument("--workload-split", default="test", choices=["train", "val", "test"])
    ap.add_argument("--per-family", type=int, default=5, help="workload prompts per family")
    ap.add_argument("--workload-max-new-tokens", type=int, default=48)
    ap.add_argument("--workload-k", type=int, default=4, help="the single drafters' fixed K (engine.k)")
    ap.add_argument("--workload-extra-k", default="", help="comma-separated: every single drafter also at these "
                    "fixed K (e.g. 8: the routed policy's longest K), counted as single drafters")
    ap.add_argument("--workload-repeats", type=int, default=1, help="runs of every policy per prompt (tokens/s: "
                    "their median; 2 or more also give the held-out oracle)")
    ap.add_argument("--target-weights", choices=["fp32", "int8", "q4"], default=None,
                    help="the workload section's target precision (default: the one the router's rows were collected at)")
    ap.add_argument("--workload-draft-weights", choices=["auto", "fp32", "int8", "q4"], default=None,
                    help="the workload section's draft precision (default: the router's rows', else auto)")
    ap.add_argument("--bench", default="runs/bench-conf/bench.json", help="a spec-bench bench.json")
    ap.add_argument("--router-eval", default=None, help="eval.md of train-router (default: next to --router)")
    ap.add_argument("--load-test", nargs="*", default=[], help="load_test.py JSON results")
    ap.add_argument("--main-job", default="runs/main/main_job.json")
    ap.add_argument("--out", default="runs/report")
    ap.add_argument("--page", default=None, help="also write the report here with its command, date and machine "
                    "(docs/results.md is the page the README points to)")  # fmt: skip
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    parts = ["# Choral benchmark report\n\n"]
    workload = None
    if args.workload_json:
        workload = json.loads(Path(args.workload_json).read_text())
    elif args.workload_router:
        from routing import workload_eval
        from serving.engine.engine_settings import EngineSettings

        trained_target, trained_drafts = workload_eval.trained_precisions(args.workload_router)
        settings = EngineSettings(target_weights=args.target_weights or trained_target,
                                  draft_weights=args.workload_draft_weights or trained_drafts,
                                  k=args.workload_k, request_k_max=8, max_batch_size=1)  # fmt: skip
        from serving.workload import load_workload

        prompts = load_workload(args.workload_split, args.per_family)
        workload = workload_eval.measure({"routed": Router.load(args.workload_router)}, prompts,
                                         max_new_tokens=args.workload_max_new_tokens, settings=settings,
                                         extra_k=[int(k) for k in args.workload_extra_k.split(",") if k.strip()],
                                         repeats=args.workload_repeats)  # fmt: skip
        workload["config"] |= {"router": args.workload_router, "split": args.workload_split, "per_family": args.per_family}
        workload_eval.save(workload, out / "workload.json")
    if workload:
        from routing import workload_eval

        workload_eval.plot(workload, out / "workload.png")
        parts.append("## Workload (six families, routed vs single drafters)\n\n" + workload_eval.markdown(workload)
                     + "\n![workload](workload.png)\n\n")  # fmt: skip
    routed = None
    if args.routed_json:
        routed = json.loads(Path(args.routed_json).read_text())
    elif args.router:
        routed = measure_routed(args)
        tmp = out / "routed.json.tmp"
        tmp.write_text(json.dumps(routed, indent=1))
        os.replace(tmp, out / "routed.json")
    if routed:
        routed_plot(routed, out / "routed.png")
        parts.append("## Routed drafts\n\n" + routed_markdown(routed) + "\n![routed](routed.png)\n\n")
    parts.append(section("Engine (spec-bench)", args.bench, lambda p: (Path(p).parent / "bench.md").read_text()))
    router_eval = args.router_eval or (str(Path(args.router).parent / "eval.md") if args.router else None)
    parts.append(section("Router (train-router, held-out prompts)", router_eval, lambda p: Path(p).read_text()))
    for lt in args.load_test:
        md = Path(lt).with_suffix(".md")
        parts.append(section(f"Server load test ({Path(lt).name})", str(md), lambda p: Path(p).read_text()))

    def main_job(p: str) -> str:
        j = json.loads(Path(p).read_text())
        rows = ["| stage | minutes |", "|---|---|"] + [f"| {k} | {v / 60:.1f} |" for k, v in j["stage_seconds"].items()]
        rows += [f"| total | {j['total_seconds'] / 60:.1f} |", "", "| request | draft | acceptance | speedup | identical to target alone |", "|---|---|---|---|---|"]
        rows += [f"| {a['domain']} | {a['draft']} | {a['acceptance_rate'] or 0:.2f} | {a['speedup']:.2f}x | {a['identical_to_target_alone']} |" for a in j["answers"]]
        return "\n".join(rows) + "\n"

    parts.append(section("Main job", args.main_job, main_job))
    (out / "report.md").write_text("".join(parts))
    print("".join(parts))
    print(f"wrote {out}/report.md")
    if args.page:
        write_page(Path(args.page), "".join(parts[1:]), argv if argv is not None else sys.argv[1:], out)
        print(f"wrote {args.page}")
    return 0


def machine() -> str:
    return describe_machine()


def write_page(page: Path, body: str, argv: list[str], out: Path) -> None:
    """The report as a docs page: what ran, when and where first, then the sections. Figures stay in
    ``--out`` (a run folder), so the page names them instead of embedding them."""
    import datetime
    import shlex

    head = ["# Results\n\n", "Written by `scripts/report.py`; every number below comes from the run named here.\n\n",
            "| | |\n|---|---|\n", f"| Command | `python scripts/report.py {shlex.join(argv)}` |\n",
            f"| Date | {datetime.date.today().isoformat()} |\n", f"| Machine | {machine()} |\n",
            f"| Figures | `{out}/` (not in the repository) |\n\n"]  # fmt: skip
    page.parent.mkdir(parents=True, exist_ok=True)
    tmp = page.with_suffix(".tmp")
    tmp.write_text("".join(head) + body.replace("![routed](routed.png)", f"Plot: `{out}/routed.png`.").replace(
        "![workload](workload.png)", f"Plot: `{out}/workload.png`."))
    os.replace(tmp, page)


if __name__ == "__main__":
    raise SystemExit(main())
