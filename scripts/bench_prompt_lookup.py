"""Baseline for Choral's ``ngram`` drafter: Hugging Face prompt lookup decoding vs plain greedy.

    python scripts/bench_prompt_lookup.py --n 3 --max-new-tokens 64 --k 4 --out runs/prompt_lookup.json
    python scripts/bench_prompt_lookup.py --k 4,10 --domains grounded,chat

On the input-grounded prompts (``serving.prompts``' ``grounded`` group: edit, extract, summarize,
quoted), where the answer copies much of the prompt, it times transformers' own prompt lookup
decoding (``model.generate(..., prompt_lookup_num_tokens=K)``: the K draft tokens are those
that followed the first, leftmost earlier occurrence of the longest suffix n-gram that recurs,
up to ``max_matching_ngram_size`` tokens; the model verifies them in one step)
against the same model's plain greedy ``generate``, on the bundled target in fp32 on the CPU with
one torch thread per core. Greedy both ways, so the outputs should be identical; a difference is
reported, not hidden (multi-token verification can round a near-tie the other way).

Each path is warmed up once untimed; then every prompt runs every path twice, interleaved in a
rotating order so machine drift hits all paths alike, and each path keeps its best time. Per
family it prints tokens/s each way and the speedup, end to end and (in brackets) for the decode
phase alone (a prefill forward, timed per prompt, subtracted: it is the same work on both paths
and a large share of a short CPU generation), tokens per decode-phase forward call (what the
drafts bought) and how many outputs match plain greedy, as a markdown table, and writes a JSON record
(command, date, machine, settings, rows) to ``--out``.

Time it alone: another session's job on the same cores skews every number.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

from serving.prompts import encode_prompt, load_prompts, resolve_domains

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
REPEATS = 2
WARMUP_TOKENS = 8


def machine() -> dict[str, Any]:
    """CPU model and the vector extensions that change the kernels' speed, cores, threads, torch."""
    cpu, flags = platform.processor() or "unknown CPU", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return {"cpu": cpu, "isa": isa, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "python": platform.python_version()}  # fmt: skip


def resolve_target(ref: str) -> Path:
    """A bundled name (converted on first use), else a local folder."""
    from serving.bundled import is_bundled_name, resolve_bundled

    return resolve_bundled(ref) if is_bundled_name(ref) else Path(ref)


class CallCounter:
    """Counts the model's forward calls: tokens per call is what prompt lookup's drafts saved."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.calls = 0
        self._handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module: Any, args: Any) -> None:
        self.calls += 1

    def remove(self) -> None:
        self._handle.remove()


@torch.no_grad()
def generate(model, prompt_ids: list[int], max_new: int, k: int | None, eos: list[int], pad: int, counter: CallCounter,
             ngram: int | None = None) -> dict:  # fmt: skip
    """One greedy generation; ``k`` None is plain greedy, else prompt lookup with K draft tokens
    matched on n-grams of up to ``ngram`` tokens (None: transformers' default)."""
    ids = torch.tensor([prompt_ids])
    extra: dict[str, int] = {} if k is None else {"prompt_lookup_num_tokens": k}
    if k is not None and ngram is not None:
        extra["max_matching_ngram_size"] = ngram
    calls = counter.calls
    start = time.perf_counter()
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, eos_token_id=eos,
        pad_token_id=pad, **extra,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    tokens = out[0, len(prompt_ids) :].tolist()
    return {"ids": tokens, "s": seconds, "calls": counter.calls - calls}


@torch.no_grad()
def prefill_seconds(model, prompt_ids: list[int]) -> float:
    """One forward over the prompt with a cache, as ``generate`` starts: subtracted from each
    path's time for the decode-phase rates, where the drafts act (prefill is the same work on
    every path, and on a CPU it is a large share of a 64-token generation)."""
    ids = torch.tensor([prompt_ids])
    start = time.perf_counter()
    model(ids, attention_mask=torch.ones_like(ids), use_cache=True)
    return time.perf_counter() - start


def path_name(k: int | None) -> str:
    return "greedy" if k is None else f"lookup_k{k}"


def parse_ks(text: str) -> list[int]:
    ks = [int(x) for x in text.replace(" ", "").split(",") if x]
    if not ks or any(k < 1 for k in ks):
        raise argparse.ArgumentTypeError(f"--k {text!r}: give K values >= 1, comma-separated")
    return ks


def summarize(rows: list[dict], ks: list[int]) -> dict:
    """Per path: total tokens over total best seconds (end to end, and decode phase with the
    measured prefill subtracted), tokens per decode-phase forward call; speedups over greedy."""
    prefill = sum(r["prefill_s"] for r in rows)
    out: dict[str, Any] = {"prompts": len(rows), "prompt_tokens_mean": sum(r["prompt_tokens"] for r in rows) / len(rows),
                           "prefill_s": prefill}  # fmt: skip
    for k in [None, *ks]:
        p = path_name(k)
        tokens, seconds = sum(r[p]["tokens"] for r in rows), sum(r[p]["s"] for r in rows)
        out[p] = {"tokens": tokens, "s": seconds, "tokens_per_s": tokens / seconds,
                  # The first token comes from the prefill call: the rest from decode calls.
                  "decode_tokens_per_s": (tokens - len(rows)) / max(seconds - prefill, 1e-9),
                  "tokens_per_call": (tokens - len(rows)) / max(1, sum(r[p]["calls"] - 1 for r in rows))}  # fmt: skip
        if k is not None:
            out[p]["speedup"] = out[p]["tokens_per_s"] / out["greedy"]["tokens_per_s"]
            out[p]["decode_speedup"] = out[p]["decode_tokens_per_s"] / out["greedy"]["decode_tokens_per_s"]
            out[p]["identical"] = sum(r[p]["identical"] for r in rows)
    return out


def markdown(record: dict) -> str:
    ks, summary = record["settings"]["k"], record["summary"]
    head = "| family | prompts | prompt tokens (mean) | greedy tok/s (decode) |"
    for k in ks:
        head += f" lookup K={k} tok/s (decode) | speedup K={k} (decode) | tokens/call K={k} | identical K={k} |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for family, s in summary.items():
        g = s["greedy"]
        line = f"| {family} | {s['prompts']} | {s['prompt_tokens_mean']:.0f} | {g['tokens_per_s']:.2f} ({g['decode_tokens_per_s']:.2f}) |"
        for k in ks:
            p = s[path_name(k)]
            line += (f" {p['tokens_per_s']:.2f} ({p['decode_tokens_per_s']:.2f}) | {p['speedup']:.2f}x ({p['decode_speedup']:.2f}x) |"
                     f" {p['tokens_per_call']:.2f} | {p['identical']}/{s['prompts']} |")  # fmt: skip
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=3, help="prompts per family (the head rows of each)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens generated per prompt, greedy (64-128 is the intended range)")
    ap.add_argument("--k", type=parse_ks, default=[4], help="prompt lookup draft lengths, comma-separated (transformers' default is 10)")
    ap.add_argument("--ngram", type=int, default=None, help="max_matching_ngram_size (default: transformers' own, 2)")
    ap.add_argument("--domains", default="grounded", help="prompt families or groups, comma-separated (default: grounded)")
    ap.add_argument("--target", default=DEFAULT_TARGET, help="bundled model name or local Hugging Face folder")
    ap.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: one per core)")
    ap.add_argument("--out", default="runs/prompt_lookup/prompt_lookup.json", help="JSON record path")
    args = ap.parse_args(argv)
    if args.n < 1 or args.max_new_tokens < 1:
        ap.error("--n and --max-new-tokens must be >= 1")
    try:
        families = resolve_domains(d.strip() for d in args.domains.split(",") if d.strip())
    except ValueError as error:
        ap.error(str(error))
    torch.set_num_threads(args.threads)
    command = shlex.join(["python", "scripts/bench_prompt_lookup.py", *(argv if argv is not None else sys.argv[1:])])

    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = resolve_target(args.target)
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.requires_grad_(False)
    load_s = time.perf_counter() - t0
    print(f"loaded {folder} in {load_s:.0f} s; {torch.get_num_threads()} threads", file=sys.stderr)
    # Both end tokens stop a chat answer; the same list on every path keeps the outputs comparable.
    eos = sorted({i for i in (tokenizer.convert_tokens_to_ids("<|im_end|>"), tokenizer.eos_token_id) if i is not None})
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    counter = CallCounter(model)
    paths: list[int | None] = [None, *args.k]
    prompts = {f: load_prompts(f, args.n) for f in families}

    # Untimed: allocator, thread pool and each path's lazy set-up (the candidate generator).
    warm = encode_prompt(tokenizer, prompts[families[0]][0])
    for k in paths:
        generate(model, warm, WARMUP_TOKENS, k, eos, pad, counter, args.ngram)

    rows: dict[str, list[dict]] = {}
    total, done, start = sum(len(p) for p in prompts.values()), 0, time.perf_counter()
    for family in families:
        rows[family] = []
        for i, prompt in enumerate(prompts[family]):
            ids = encode_prompt(tokenizer, prompt)
            best: dict[str, dict] = {}
            prefill = float("inf")
            for rep in range(REPEATS):
                prefill = min(prefill, prefill_seconds(model, ids))
                # Rotate the order per prompt and repeat, so no path always runs first (or after
                # the same neighbour).
                shift = (i + rep) % len(paths)
                for k in paths[shift:] + paths[:shift]:
                    got = generate(model, ids, args.max_new_tokens, k, eos, pad, counter, args.ngram)
                    name = path_name(k)
                    if name not in best or got["s"] < best[name]["s"]:
                        best[name] = got
            reference = best["greedy"]["ids"]
            row: dict[str, Any] = {"id": prompt.id, "prompt_tokens": len(ids), "prefill_s": prefill}
            for k in paths:
                b = best[path_name(k)]
                row[path_name(k)] = {"tokens": len(b["ids"]), "s": b["s"], "calls": b["calls"]}
                if k is not None:
                    same = b["ids"] == reference
                    row[path_name(k)]["identical"] = same
                    if not same:
                        row[path_name(k)]["first_diff"] = next(
                            (j for j, (a, c) in enumerate(zip(reference, b["ids"])) if a != c), min(len(reference), len(b["ids"]))
                        )  # fmt: skip
            row["greedy_text"] = tokenizer.decode(reference, skip_special_tokens=True)
            rows[family].append(row)
            done += 1
            rates = ", ".join(f"{path_name(k)} {row[path_name(k)]['tokens'] / row[path_name(k)]['s']:.2f} tok/s" for k in paths)
            print(f"[{done}/{total} {time.perf_counter() - start:.0f} s] {prompt.id} ({len(ids)} tokens, prefill {prefill:.1f} s): {rates}",
                  file=sys.stderr)  # fmt: skip
    counter.remove()

    summary = {f: summarize(r, args.k) for f, r in rows.items()}
    if len(rows) > 1:
        summary["all"] = summarize([r for rs in rows.values() for r in rs], args.k)
    record = {
        "command": command,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": machine(),
        "settings": {"target": args.target, "folder": str(folder), "dtype": "float32", "device": "cpu", "families": families,
                     "n": args.n, "max_new_tokens": args.max_new_tokens, "k": args.k,
                     "max_matching_ngram_size": args.ngram or 2,  # 2: transformers' default
                     "repeats": REPEATS, "timing": "best of 2 interleaved runs per prompt and path, after one untimed warm-up per path",
                     "transformers": __import__("transformers").__version__, "load_s": load_s},  # fmt: skip
        "summary": summary,
        "rows": rows,
    }
    table = markdown(record)
    m = record["machine"]
    print(f"\n`{command}`\n\n{m['cpu']} ({', '.join(m['isa']) or 'no AVX2'}), {m['cores']} cores, {m['threads']} threads, "
          f"torch {m['torch']}; fp32, greedy, {args.max_new_tokens} new tokens, {args.n} prompts per family\n")  # fmt: skip
    print(table)
    record["markdown"] = table
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
