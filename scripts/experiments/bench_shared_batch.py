"""One engine for every drafter against one engine per draft: `serve` under a mixed load.

    python scripts/experiments/bench_shared_batch.py --old-bin /work/venv-old/bin \\
        --code-draft runs/main/draft-code/best --out runs/shared-batch

``--old-bin`` holds the `serve` (and `python`) of an install of the commit before the drafter
engine (cc6ee91: one ``SpeculativeEngine``, with its own target KV cache and batch, per draft
name plus ``none``); this checkout's `serve` runs one engine with every drafter in one batch.
Both serve the same router-less choice of three model drafters (the bundled 0.5B as ``base``, a
code draft from train-draft as ``code``, the 0.5B cut to its first 12 layers as ``cut``) and
``none``, with ``engine.max_batch_size=8``, K=4, int8 drafts, the same max_len.

1. Mixed load: ``serving.tools.load_test`` with 8 concurrent streaming clients, request i forced to
   drafter i mod 4 (base, code, cut, none), greedy, the same requests on both servers. Reported:
   aggregate tokens/s, errors, and the server's peak resident memory (VmHWM at the end) and its
   resident memory once warmed up.
2. A lone request: this checkout's server with ``max_batch_size=8`` and with ``1``, one client
   sending the same requests one at a time (``base``); tokens/s of each.

Writes ``shared_batch.json`` (command, date, machine, every number) and ``shared_batch.md``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from serving.engine.devices import describe_machine
from serving.server.launch import free_port, stop, wait_healthy

TARGET = "qwen2.5-coder-1.5b-instruct"
BASE = "qwen2.5-coder-0.5b-instruct"
ROOT = Path(__file__).resolve().parents[2]


def rss_gib(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    return {line.split(":")[0]: int(line.split()[1]) / 2**20 for line in status if line.startswith(("VmHWM", "VmRSS"))}


def cut_draft(path: Path) -> Path:
    """The 0.5B's first 12 of 24 decoder layers, saved once (an untrained layer-cut drafter)."""
    if (path / "config.json").exists():
        return path
    from serving.engine.models import load_model, load_tokenizer
    from training.students import derive_student

    model = load_model(BASE)
    derive_student(model, list(range(12))).save_pretrained(path)
    load_tokenizer(BASE).save_pretrained(path)
    return path


def make_router(python: str, path: Path, drafts: dict[str, str]) -> None:
    """An untrained router.pt naming the drafts, written by that install's own code."""
    code = f"from routing.router import Router; Router.create({drafts!r}, {TARGET!r}).save({str(path)!r})"
    subprocess.run([python, "-c", code], check=True, cwd="/tmp")


def start(bin_dir: Path, router: Path, batch: int, max_len: int, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [str(bin_dir / "serve"), "--router", str(router), "--port", str(port), f"engine.max_batch_size={batch}",
           "engine.k=4", "engine.draft_weights=int8", f"engine.max_len={max_len}",
           "request_timeout_s=3600"]  # fmt: skip  # every request finishes: the same work on both servers
    print("$", " ".join(cmd), flush=True)
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd="/tmp")
    url = f"http://127.0.0.1:{port}"
    wait_healthy(url, proc, timeout_s=900)
    return proc, url


def load_test(url: str, out: Path, args_list: list[str]) -> dict:
    cmd = [sys.executable, "-m", "serving.tools.load_test", "--url", url, "--out", str(out), "--quiet", *args_list]
    print("$", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=False, cwd=ROOT)
    return json.loads((out / "load_test.json").read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old-bin", required=True, help="bin folder of the per-draft-engine install (its serve and python)")
    ap.add_argument("--code-draft", default="runs/main/draft-code/best", help="a code draft folder from train-draft")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--lone-requests", type=int, default=3)
    ap.add_argument("--domains", default="math",
                    help="prompt domains of the mixed load; math's prompts are short, so the load is decode-bound "
                         "(long prompts make both designs wait on the same prefills)")
    ap.add_argument("--n-prompts", type=int, default=8, help="prompts per domain")
    ap.add_argument("--no-lone", action="store_true", help="skip the lone-request part")
    ap.add_argument("--out", default="runs/shared-batch")
    args = ap.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    code = Path(args.code_draft).resolve()
    if not (code / "config.json").exists():
        raise SystemExit(f"--code-draft {code}: no model there; run scripts/main_job.py (or train-draft) first")
    drafts = {"base": BASE, "code": str(code), "cut": str(cut_draft(out / "draft-cut"))}
    new_bin = Path(shutil.which("serve") or sys.exit("this checkout's serve is not on PATH: pip install -e .")).parent
    sides = {"one engine (this checkout)": new_bin, "engine per draft (--old-bin)": Path(args.old_bin)}
    mixed = ["--concurrency", "8", "--requests", str(args.requests), "--max-tokens", str(args.max_tokens),
             "--draft", "base,code,cut,none", "--domains", args.domains, "--n-prompts", str(args.n_prompts)]  # fmt: skip
    record: dict = {
        "command": " ".join(["python", "scripts/experiments/bench_shared_batch.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.date.today().isoformat(), "machine": describe_machine(), "drafts": drafts,
        "mixed": {}, "lone": {},
    }  # fmt: skip
    for i, (label, bin_dir) in enumerate(sides.items()):
        router = out / f"router-{i}.pt"
        make_router(str(bin_dir / "python"), router, drafts)
        proc, url = start(bin_dir, router, 8, args.max_len, out / f"serve-mixed-{i}.log")
        try:
            warmed = rss_gib(proc.pid)
            report = load_test(url, out / f"mixed-{i}", mixed)
            peak = rss_gib(proc.pid)
        finally:
            stop([proc])
        record["mixed"][label] = {"tokens_per_s": report["throughput_tokens_per_s"], "errors": report["errors"],
                                  "requests": report["n_requests"], "tokens": report["completion_tokens"],
                                  "wall_s": report["wall_s"], "rss_warm_gib": warmed["VmRSS"], "peak_rss_gib": peak["VmHWM"],
                                  "texts": [r["text"] for r in report["rows"]]}  # fmt: skip
    for batch in () if args.no_lone else (8, 1):
        router = out / "router-0.pt"
        proc, url = start(new_bin, router, batch, args.max_len, out / f"serve-lone-{batch}.log")
        try:
            report = load_test(url, out / f"lone-{batch}", ["--concurrency", "1", "--requests", str(args.lone_requests),
                                                             "--max-tokens", str(args.max_tokens), "--draft", "base",
                                                             "--domains", "code", "--n-prompts", str(args.lone_requests)])  # fmt: skip
        finally:
            stop([proc])
        record["lone"][str(batch)] = {"tokens_per_s": report["throughput_tokens_per_s"], "errors": report["errors"]}
    new, old = record["mixed"].values()
    record["same_texts"] = new["texts"] == old["texts"]
    record["throughput_ratio"] = new["tokens_per_s"] / old["tokens_per_s"]
    record["peak_rss_saved_gib"] = old["peak_rss_gib"] - new["peak_rss_gib"]
    if record["lone"]:
        record["lone_ratio_8_vs_1"] = record["lone"]["8"]["tokens_per_s"] / record["lone"]["1"]["tokens_per_s"]
    (out / "shared_batch.json").write_text(json.dumps(record, indent=1))
    md = markdown(record)
    (out / "shared_batch.md").write_text(md)
    print(md)
    return 0


def markdown(r: dict) -> str:
    lines = [f"`{r['command']}` ({r['date']}, {r['machine']})", "",
             "| server | requests | errors | tokens/s | peak RSS GiB | RSS warmed up GiB |", "|---|---|---|---|---|---|"]
    for label, m in r["mixed"].items():
        lines.append(f"| {label} | {m['requests']} | {m['errors']} | {m['tokens_per_s']:.2f} | {m['peak_rss_gib']:.2f} | {m['rss_warm_gib']:.2f} |")
    lines += ["", f"One engine vs engine per draft: **{r['throughput_ratio']:.2f}x** tokens/s, "
              f"{r['peak_rss_saved_gib']:.2f} GiB less peak RSS; same answers: {r['same_texts']}."]  # fmt: skip
    if r["lone"]:
        lines += ["", f"A lone request (base, {r['lone']['8']['tokens_per_s']:.2f} tok/s at max_batch_size=8, "
                      f"{r['lone']['1']['tokens_per_s']:.2f} at 1): **{r['lone_ratio_8_vs_1']:.2f}x**."]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
