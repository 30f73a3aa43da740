"""A neighbour's latency and the server's memory beside requests with a 1.9 MB prediction.

    python scripts/prediction_pressure.py --serve "serve --router router.pt"       # starts serve itself
    python scripts/prediction_pressure.py --url http://127.0.0.1:8000 --pid 1234   # a running server

Issue 61's second reproducer: a 1.9 MB ``prediction.content`` (under the 2 MiB body limit) once
held the engine thread for seconds and grew the server by ~370 MB a request. This measures, on
whatever pair the server runs:

1. a neighbour's 40-token greedy request alone (median of ``--repeats``);
2. the same request sent while a 1.9 MB-prediction request is in flight (median): the bar is 2x;
3. the server process's RSS after the first big request and after ``--big`` (20) more: flat.

A script, not a test: its numbers depend on the machine. Prints one line per figure and a JSON
summary; exit 1 if a bar is missed.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
import urllib.request

from serving.server.launch import serving

NEIGHBOUR = {"prompt": "def fibonacci(n):", "max_tokens": 40, "temperature": 0}


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=900) as r:
        return json.loads(r.read())


def big_body(model: str, size: int = 1_900_000) -> dict:
    """A request whose prediction is ``size`` bytes of code-like text (words, newlines)."""
    rng = random.Random(61)
    words = ["def", "return", "x", "self", "value", "if", "else", "for", "in", "range", "(", ")", ":", "\n    "]
    text, length = [], 0
    while length < size:
        text.append(rng.choice(words) + " ")
        length += len(text[-1])
    content = "".join(text)[:size]
    return {"model": model, "prompt": "def parse(line):", "max_tokens": 16, "temperature": 0,
            "prediction": {"type": "content", "content": content}}  # fmt: skip


def timed(url: str, body: dict) -> float:
    started = time.perf_counter()
    post(url, body)
    return time.perf_counter() - started


def rss_mb(pid: int) -> float:
    import psutil

    proc = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20


def measure(url: str, pid: int | None, repeats: int, big: int) -> dict:
    with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
        model = json.loads(r.read())["data"][0]["id"]
    neighbour = {"model": model, **NEIGHBOUR}
    heavy = big_body(model)
    timed(url, neighbour)  # warm-up
    solo = [timed(url, neighbour) for _ in range(repeats)]
    beside = []
    for _ in range(repeats):
        t = threading.Thread(target=post, args=(url, heavy))
        t.start()
        time.sleep(0.05)  # the big request reaches the server first
        beside.append(timed(url, neighbour))
        t.join()
    out = {"solo_s": statistics.median(solo), "beside_big_s": statistics.median(beside)}
    out["ratio"] = out["beside_big_s"] / out["solo_s"]
    if pid is not None:
        out["rss_mb_after_first_big"] = rss_mb(pid)
        for _ in range(big):
            post(url, heavy)
        out["rss_mb_after_more"] = rss_mb(pid)
        out["big_requests"] = big + repeats
        out["rss_growth_mb"] = out["rss_mb_after_more"] - out["rss_mb_after_first_big"]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server (give --pid for the memory figures)")
    where.add_argument("--serve", help="a serve command to start on a free loopback port")
    ap.add_argument("--pid", type=int, help="the running server's process id")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--big", type=int, default=20, help="big requests between the two RSS readings")
    ap.add_argument("--max-rss-growth-mb", type=float, default=100.0)
    args = ap.parse_args(argv)
    if args.serve:
        with serving(args.serve) as (url, proc):
            out = measure(url, proc.pid, args.repeats, args.big)
    else:
        out = measure(args.url, args.pid, args.repeats, args.big)
    print(f"neighbour alone {out['solo_s']:.3f} s, beside a 1.9 MB prediction {out['beside_big_s']:.3f} s: {out['ratio']:.2f}x (bar 2x)")
    ok = out["ratio"] <= 2.0
    if "rss_growth_mb" in out:
        print(f"server RSS {out['rss_mb_after_first_big']:.0f} MB after the first big requests, {out['rss_mb_after_more']:.0f} MB "
              f"after {args.big} more: {out['rss_growth_mb']:+.0f} MB (bar {args.max_rss_growth_mb:.0f} MB)")
        ok &= out["rss_growth_mb"] <= args.max_rss_growth_mb
    print(json.dumps(out))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
