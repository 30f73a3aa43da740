"""Model-free drafters on input-grounded prompts: the target alone, transformers' prompt lookup
decoding, and Choral's ``ngram`` and ``suffix`` drafters, on the same prompts, pair and precision.

    python scripts/experiments/bench_grounded.py --prompts-per-domain 10 --max-new-tokens 48 --k 4 \\
        --out runs/grounded
    # choose a drafter setting on other prompts (10-19), then report on 0-9 with it
    python scripts/experiments/bench_grounded.py --domains edit --offset 10 --paths target,ngram \\
        --engine ngram.min_n=4 ngram.max_n=8 --out runs/grounded-val

Per prompt of each grounded family (serving.prompts: edit, extract, summarize, quoted) the four
decoders run one after the other, greedy, their order rotating from prompt to prompt so machine
drift hits all alike. ``ngram`` and ``suffix`` each run in an engine of their own, so the suffix
drafter's cross-request cache holds only earlier prompts' answers (as a server's would), never
another decoder's answer to the same prompt. Every path first decodes an untimed warm-up prompt
from the code domain. Reports per family tokens/s, speedup over the target alone and over prompt
lookup, acceptance, and whether every output equals the target's own greedy output; writes
``grounded.json`` (command, date, machine, every row) and ``grounded.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

from tqdm import tqdm

from serving.config import load_config
from serving.engine.devices import describe_machine
from serving.engine.engine_settings import EngineSettings
from serving.engine.loader import build_engine, load_models, prepare_kernels
from serving.prompts import GROUNDED_DOMAINS, encode_prompt, load_prompts
from serving.tools.bench import hf_assisted, run_engine

TARGET = "qwen2.5-coder-1.5b-instruct"
PATHS = ("target", "ngram", "suffix", "prompt lookup")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default=TARGET, help="the target model (default: the bundled 1.5B)")
    ap.add_argument("--prompts-per-domain", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k", type=int, default=4, help="tokens a drafter proposes per step (prompt lookup's num tokens too)")
    ap.add_argument("--domains", default=",".join(GROUNDED_DOMAINS))
    ap.add_argument("--hf-domains", default=None,
                    help="families on which transformers' prompt lookup runs too (default: all); it is the slowest path")
    ap.add_argument("--target-weights", default="fp32", choices=["fp32", "int8", "q4"],
                    help="the target's precision on the CPU kernels; prompt lookup runs the same prepared model")
    ap.add_argument("--offset", type=int, default=0,
                    help="skip each family's first N prompts (e.g. tune drafter settings on prompts 10-19, report on 0-9)")
    ap.add_argument("--paths", default=",".join(PATHS), help=f"decoders to run, a comma list of {', '.join(PATHS)} "
                    "(the target alone always runs: the others are compared with it)")
    ap.add_argument("--engine", nargs="*", default=[], metavar="KEY=VALUE",
                    help="engine settings for the drafters, dotted (e.g. ngram.min_n=2 suffix.max_depth=32)")
    ap.add_argument("--out", default="runs/grounded")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    if args.offset < 0 or args.prompts_per_domain < 1:
        raise SystemExit(f"bench_grounded: --offset {args.offset} must be >= 0 and --prompts-per-domain "
                         f"{args.prompts_per_domain} >= 1")
    asked = {x.strip() for x in args.paths.split(",")}
    paths = ["target", *(p for p in PATHS[1:] if p in asked)]
    unknown = asked - set(PATHS)
    if unknown:
        raise SystemExit(f"bench_grounded: unknown --paths {sorted(unknown)}; choose from {', '.join(PATHS)}")
    # grounded prompts stay under 1k tokens
    settings = load_config(EngineSettings, None, ["device=cpu", f"k={args.k}", "max_batch_size=1", "max_len=2048",
                                                  f"target_weights={args.target_weights}", *args.engine])  # fmt: skip
    tokenizer, target, _ = load_models(settings, args.target, [])
    spec = settings.engine_config(draft=True, device=target.device)
    prepare_kernels(settings, [target], [], spec.step_widths)
    engines = {
        "target": build_engine(settings, tokenizer, target, k=1, k_buckets=(1,)),
        **{name: build_engine(settings, tokenizer, target, {name: name}) for name in ("ngram", "suffix") if name in paths},
    }  # fmt: skip
    eos = sorted(engines["target"]._eos)

    def decode(path: str, ids: list[int], max_new: int) -> tuple[list[int], float, dict]:
        if path == "prompt lookup":
            out_ids, seconds = hf_assisted(target, args.k, ids, max_new, eos, True)
            return out_ids, seconds, {}
        out_ids, stats = run_engine(engines[path], ids, max_new)
        return out_ids, stats["total_time_s"], stats

    warm = encode_prompt(tokenizer, load_prompts("code", 1)[0])
    for path in paths:
        decode(path, warm, 8)

    domains = [d.strip() for d in args.domains.split(",")]
    hf_domains = None if args.hf_domains is None else {d.strip() for d in args.hf_domains.split(",")}
    prompts = {d: load_prompts(d, args.prompts_per_domain, offset=args.offset) for d in domains}
    rows: dict[str, list[dict]] = {}
    with tqdm(total=sum(len(p) for p in prompts.values()), desc="grounded", unit="prompt") as bar:
        for d in domains:
            rows[d] = []
            for i, prompt in enumerate(prompts[d]):
                ids = encode_prompt(tokenizer, prompt)
                row: dict = {"id": prompt.id, "prompt_tokens": len(ids)}
                here = [p for p in paths if p != "prompt lookup" or hf_domains is None or d in hf_domains]
                for path in here[i % len(here) :] + here[: i % len(here)]:
                    out_ids, seconds, stats = decode(path, ids, args.max_new_tokens)
                    row[path] = {"tokens": len(out_ids), "seconds": seconds, "ids": out_ids,
                                 "drafted": stats.get("drafted", 0), "accepted": stats.get("accepted", 0)}  # fmt: skip
                for path in here[1:]:
                    row[path]["identical"] = row[path]["ids"] == row["target"]["ids"]
                rows[d].append(row)
                bar.update(1)
    summary = {d: summarize(r) for d, r in rows.items()} | {"all": summarize([x for r in rows.values() for x in r])}
    record = {
        "command": " ".join(["python", "scripts/experiments/bench_grounded.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.date.today().isoformat(),
        "machine": describe_machine(),
        "settings": {"target": args.target, "k": settings.k, "max_new_tokens": args.max_new_tokens, "dtype": settings.dtype,
                     "target_weights": settings.target_weights,
                     "choral_cpu_kernels": settings.cpu_kernels, "prompts_per_domain": args.prompts_per_domain,
                     "offset": args.offset, "ngram": dataclasses.asdict(settings.ngram),
                     "suffix": dataclasses.asdict(settings.suffix)},
        "summary": summary,
        "rows": rows,
    }  # fmt: skip
    (out / "grounded.json").write_text(json.dumps(record, indent=1))
    md = markdown(record)
    (out / "grounded.md").write_text(md)
    print(md)
    return 0


def summarize(rows: list[dict]) -> dict:
    """Tokens/s per path over all rows (total tokens / total seconds), speedups, acceptance; the
    comparisons with prompt lookup over the rows where it ran."""

    def rate(path: str, rs: list[dict]) -> float | None:
        rs = [r for r in rs if path in r]
        return sum(r[path]["tokens"] for r in rs) / sum(r[path]["seconds"] for r in rs) if rs else None

    with_hf = [r for r in rows if "prompt lookup" in r]
    out: dict = {"prompts": len(rows), "prompts_with_prompt_lookup": len(with_hf),
                 "tokens_per_s": {p: rate(p, rows) for p in PATHS}}  # fmt: skip
    for p in ("ngram", "suffix"):
        if not any(p in r for r in rows):  # not among --paths
            continue
        drafted = sum(r[p]["drafted"] for r in rows)
        out[p] = {
            "speedup_vs_target": rate(p, rows) / rate("target", rows),
            # same prompts on both sides: only those where prompt lookup ran
            "vs_prompt_lookup": rate(p, with_hf) / rate("prompt lookup", with_hf) if with_hf else None,
            "acceptance": sum(r[p]["accepted"] for r in rows) / drafted if drafted else 0.0,
            "identical": sum(r[p]["identical"] for r in rows),
        }
    if with_hf:
        out["prompt lookup"] = {"speedup_vs_target": rate("prompt lookup", with_hf) / rate("target", with_hf),
                                "identical": sum(r["prompt lookup"]["identical"] for r in with_hf)}  # fmt: skip
    return out


def markdown(record: dict) -> str:
    s = record["settings"]
    lines = [
        f"`{record['command']}` ({record['date']}, {record['machine']}); {s['target']} {s['dtype']}, target weights "
        f"{s.get('target_weights', 'fp32')} (prompt lookup runs the same prepared model), greedy, "
        f"{s['max_new_tokens']} new tokens, K={s['k']} (prompt lookup: prompt_lookup_num_tokens={s['k']}); "
        f"prompts from index {s.get('offset', 0)} of each family; ngram {s.get('ngram')}; suffix {s.get('suffix')}.",
        "",
        "| family | prompts | target tok/s | prompt lookup tok/s | ngram tok/s | suffix tok/s | ngram vs target | suffix vs target "
        "| ngram vs prompt lookup | suffix vs prompt lookup | acceptance ngram / suffix | identical ngram / suffix / prompt lookup |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    def num(v: float | None, unit: str = "") -> str:
        return "-" if v is None else f"{v:.2f}{unit}"

    for d, v in record["summary"].items():
        t, n, x = v["tokens_per_s"], v.get("ngram", {}), v.get("suffix", {})  # a path not run: "-"
        hf = v.get("prompt lookup", {}).get("identical")
        lines.append(
            f"| {d} | {v['prompts']} | {num(t['target'])} | {num(t['prompt lookup'])} | {num(t['ngram'])} | {num(t['suffix'])} "
            f"| {num(n.get('speedup_vs_target'), 'x')} | {num(x.get('speedup_vs_target'), 'x')} "
            f"| {num(n.get('vs_prompt_lookup'), 'x')} | {num(x.get('vs_prompt_lookup'), 'x')} "
            f"| {num(n.get('acceptance'))} / {num(x.get('acceptance'))} "
            f"| {n.get('identical', '-')} / {x.get('identical', '-')} / {'-' if hf is None else hf} of {v['prompts']} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
