"""Fair admission on a served model (issue 75): one client holding hundreds of streams against ten
others, and a thousand connections that never send a request.

    python scripts/experiments/probe_admission.py --out docs/experiments/data

Starts ``serve`` (the bundled pair by default, the target alone: the probe is about admission, not
drafting) and measures, with the official ``openai`` client (its async form, a connection per
stream):

1. **alone**: each of the ten clients' requests sent by itself, one after another;
2. **together**: the ten sent at once, no one else on the server;
3. **beside the hog**: one client (its own API key) opens ``--hog`` streams at once and keeps them
   open; once the server runs them, the ten send the same requests. Counted: the hog's 429s (the
   limit they name), the ten's latencies against 1 and 2, and whether their answers are the ones
   they got alone (greedy: they must be);
4. **idle**: ``--idle`` TCP connections opened and never written to; the time until the server has
   closed each, and a request served while they are open.

Each client is its own API key (``serve`` has none configured, so a key names a client; see
``serving/server/admission.py``). Writes ``admission_probe.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import resource
import socket
import statistics
import sys
import time
from pathlib import Path

PROMPTS = [
    "Write a Python function that reverses a string.", "What is the capital of Australia?",
    "Explain what a hash map is in two sentences.", "Give three tips for writing clear commit messages.",
    "Convert 100 degrees Fahrenheit to Celsius.", "What does HTTP status 429 mean?",
    "Write a SQL query that counts rows in a table named users.", "Name two differences between lists and tuples in Python.",
    "What is the time complexity of binary search?", "Write a haiku about compilers.",
]  # fmt: skip


MODEL = {"name": ""}  # the served model's id, read once the server is up


async def ask(base: str, key: str, prompt: str, max_tokens: int, stream: bool = False, hold: asyncio.Event | None = None):
    """(seconds, text or None, the error's status and message or None) of one chat request."""
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=base, api_key=key, max_retries=0, timeout=900,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=2000), timeout=900))  # fmt: skip
    started = time.perf_counter()
    try:
        kwargs = dict(model=MODEL["name"], messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens, temperature=0)
        if not stream:
            r = await client.chat.completions.create(**kwargs)
            return time.perf_counter() - started, r.choices[0].message.content, None
        text = ""
        async for chunk in await client.chat.completions.create(stream=True, **kwargs):
            if hold is not None:
                hold.set()  # the hog's first stream is running
            text += (chunk.choices[0].delta.content or "") if chunk.choices else ""
        return time.perf_counter() - started, text, None
    except openai.APIStatusError as e:
        return time.perf_counter() - started, None, (e.status_code, str(e.message)[:200])
    finally:
        await client.close()


async def probe(base: str, args) -> dict:
    keys = [f"client-{i}" for i in range(10)]
    alone = [await ask(base, k, p, args.max_tokens) for k, p in zip(keys, PROMPTS)]
    together = await asyncio.gather(*(ask(base, k, p, args.max_tokens) for k, p in zip(keys, PROMPTS)))
    running = asyncio.Event()
    hog = [asyncio.create_task(ask(base, "hog", PROMPTS[i % 10], args.max_tokens, stream=True, hold=running))
           for i in range(args.hog)]  # fmt: skip
    await asyncio.wait_for(running.wait(), 900)
    beside = await asyncio.gather(*(ask(base, k, p, args.max_tokens) for k, p in zip(keys, PROMPTS)))
    hog_done = await asyncio.gather(*hog)
    refused = [e for _, _, e in hog_done if e is not None]
    out = {
        "alone_s": [round(s, 2) for s, _, _ in alone],
        "together_s": [round(s, 2) for s, _, _ in together],
        "beside_hog_s": [round(s, 2) for s, _, _ in beside],
        "beside_over_alone": [round(b[0] / a[0], 2) for a, b in zip(alone, beside)],
        "beside_over_together": [round(b[0] / t[0], 2) for t, b in zip(together, beside)],
        "identical_to_alone": sum(a[1] == b[1] == t[1] for a, t, b in zip(alone, together, beside)),
        "others_refused": sum(e is not None for _, _, e in beside),
        "hog_streams": args.hog,
        "hog_served": sum(e is None for _, _, e in hog_done),
        "hog_refused": len(refused),
        "hog_refusal": refused[0] if refused else None,
    }
    out["max_beside_over_alone"] = max(out["beside_over_alone"])
    out["max_beside_over_together"] = max(out["beside_over_together"])
    out["median_beside_over_together"] = statistics.median(out["beside_over_together"])
    return out


def idle(host: str, port: int, n: int, base: str, max_tokens: int) -> dict:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, n + 512)), hard))
    opened = time.monotonic()
    socks = [socket.create_connection((host, port), timeout=120) for _ in range(n)]
    served = asyncio.run(ask(base, "during-idle", PROMPTS[0], max_tokens))
    closed = []
    for s in socks:
        closed.append(s.recv(1) == b"")
        s.close()
    return {"connections": n, "closed_by_server": sum(closed), "all_closed_after_s": round(time.monotonic() - opened, 2),
            "request_while_open": served[2] is None}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--hog", type=int, default=300, help="streams the one client opens at once")
    ap.add_argument("--idle", type=int, default=1000, help="connections opened and never written to")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--serve-arg", action="append", default=[], help="an extra key=value for serve (repeatable)")
    ap.add_argument("--out", default="runs/admission")
    args = ap.parse_args(argv)

    from serving.engine.devices import describe_machine
    from serving.files import atomic_path
    from serving.server.launch import serving_drafts

    serve_args = ["engine.max_batch_size=8", "idle_timeout_s=10", *args.serve_arg]
    with serving_drafts(args.target, {"draft": args.draft}, serve_args) as (client, model):
        base, MODEL["name"] = str(client.base_url).rstrip("/"), model
        results = asyncio.run(probe(base, args))
        host, port = base.removeprefix("http://").split("/")[0].split(":")
        results["idle"] = idle(host, int(port), args.idle, base, args.max_tokens)
    report = {"date": datetime.date.today().isoformat(), "machine": describe_machine(with_threads=True),
              "command": "python " + " ".join(sys.argv), "serve_args": serve_args, "results": results}  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with atomic_path(out / "admission_probe.json") as tmp:
        tmp.write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
