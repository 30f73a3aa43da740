"""Send seeded random request bodies to a running server beside valid neighbours, and check it.

    python scripts/fuzz_server.py --url http://127.0.0.1:8000 --bodies 2000
    python scripts/fuzz_server.py --serve "serve --router router.pt" --bodies 2000   # starts serve itself

Bodies: a valid body with fields replaced, dropped or added at random (random types and sizes:
integers of thousands of digits, NaN, booleans where numbers go, 300 KB strings, nested lists),
a few cut short. Between them run valid greedy neighbours. It checks what issue 61 asks: no 5xx,
every neighbour's answer as it was alone, and the server's ``choral_requests_total`` counters
moving by exactly the client's tally. Exit 1 on any failure. The suite runs the same generator
on 200 bodies (tests/test_server.py); this is the long run.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from serving.server.launch import serving

# Request fields, and "5": a token id, as a logit_bias key.
FUZZ_KEYS = ["model", "prompt", "messages", "role", "content", "type", "text", "max_tokens", "temperature", "top_p",
             "top_k", "seed", "stop", "stream", "stream_options", "include_usage", "n", "draft", "prediction", "logprobs",
             "echo", "best_of", "tools", "logit_bias", "response_format", "suffix", "user", "x", "top_logprobs",
             "frequency_penalty", "presence_penalty", "min_p", "repetition_penalty", "5"]  # fmt: skip
CHAT = [{"role": "user", "content": "Say hi."}]
NEIGHBOURS = [("completions", {"prompt": "def f(x):", "max_tokens": 6, "temperature": 0}),
              ("chat", {"messages": CHAT, "max_tokens": 6, "temperature": 0})]  # fmt: skip


def fuzz_value(rng: random.Random, depth: int = 0):
    """A JSON value of random type and size: what a broken or hostile client might put anywhere."""
    kinds = ["int", "bigint", "float", "special", "bool", "null", "str", "longstr", "unicode"] + (["list", "dict"] if depth < 3 else [])
    kind = rng.choice(kinds)
    if kind == "int":
        return rng.choice([0, 1, -1, 2, 7, 2**31, 2**63, -(2**63), 2**64])
    if kind == "bigint":  # written into the JSON text by fuzz_body: Python cannot str() 4,301 digits
        return f"__DIGITS_{rng.choice([20, 400, 4301, 6000])}__"
    if kind == "float":
        return rng.choice([0.0, 0.5, 1.0, -0.5, 1e-300, 1e300, 2.5])
    if kind == "special":
        return rng.choice([float("nan"), float("inf"), float("-inf")])  # Python's json writes and reads these
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "str":
        return rng.choice(["", "hi", "MODEL", "text", "none", "ngram", "content", "user", "0.5", "true"])
    if kind == "longstr":
        return "word " * rng.choice([10, 1000, 60_000])
    if kind == "unicode":
        return rng.choice(["é" * 50, "\u2028", "漢字", "\x00"])
    if kind == "list":
        return [fuzz_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(FUZZ_KEYS): fuzz_value(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def fuzz_body(rng: random.Random, model: str, chat: bool) -> bytes:
    """A valid body with some fields replaced, dropped or added at random; sometimes not JSON."""
    body = {"model": model, "max_tokens": 3, "temperature": 0}
    body.update({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hello"})
    for _ in range(rng.randint(1, 4)):
        key = rng.choice(FUZZ_KEYS)
        action = rng.random()
        if action < 0.15:
            body.pop(key, None)
        elif action < 0.3 and chat:
            body["messages"] = [{rng.choice(FUZZ_KEYS): fuzz_value(rng, 1) for _ in range(2)}]
        else:
            body[key] = fuzz_value(rng)
    raw = re.sub(rb'"__DIGITS_(\d+)__"', lambda m: b"9" * int(m.group(1)), json.dumps(body).encode())
    if rng.random() < 0.05:
        raw = raw[: rng.randint(0, len(raw))]  # cut short
    return raw


def post(url: str, path: str, data: bytes) -> tuple[int, str]:
    req = urllib.request.Request(url + path, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def request_counts(url: str) -> dict[tuple[str, str], float]:
    """``choral_requests_total`` by (endpoint, status)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=60) as r:
        text = r.read().decode()
    return {(s.labels["endpoint"], s.labels["status"]): s.value for fam in text_string_to_metric_families(text)
            for s in fam.samples if s.name == "choral_requests_total"}  # fmt: skip


def answer(status: int, text: str) -> tuple[int, str | None]:
    """What a neighbour's result is compared by: its status and the text it generated."""
    if status != 200:
        return status, None
    choice = json.loads(text)["choices"][0]
    return status, choice.get("text", (choice.get("message") or {}).get("content"))


def fuzz(url: str, model: str, bodies: int, seed: int = 61, neighbours: int | None = None, workers: int = 8) -> list[str]:
    """Run ``bodies`` fuzzed bodies beside valid neighbours; returns the failures found (empty: all held)."""
    rng = random.Random(seed)
    fuzzed = [(chat, fuzz_body(rng, model, chat)) for chat in (rng.random() < 0.5 for _ in range(bodies))]
    good = [(endpoint, json.dumps({"model": model, **body}).encode()) for endpoint, body in NEIGHBOURS]
    path = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
    solo = [answer(*post(url, path[endpoint], body)) for endpoint, body in good]
    jobs = [("fuzz", i) for i in range(bodies)] + [("good", i % 2) for i in range(neighbours or max(2, bodies // 5))]
    random.Random(seed + 1).shuffle(jobs)

    def run(job):
        chat, raw = (fuzzed[job[1]][0], fuzzed[job[1]][1]) if job[0] == "fuzz" else (good[job[1]][0] == "chat", good[job[1]][1])
        endpoint = "chat" if chat else "completions"
        return endpoint, *post(url, path[endpoint], raw)

    before = request_counts(url)
    with ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(run, jobs))
    after = request_counts(url)
    failures, tally = [], {}
    for job, (endpoint, status, text) in zip(jobs, results):
        tally[endpoint, str(status)] = tally.get((endpoint, str(status)), 0) + 1
        if status >= 500:
            failures.append(f"a fuzzed body got {status}: {fuzzed[job[1]][1][:300]!r} -> {text[:300]}")
        elif job[0] == "good" and answer(status, text) != solo[job[1]]:
            failures.append(f"a valid {endpoint} neighbour answered {answer(status, text)} beside fuzzed bodies, {solo[job[1]]} alone")
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    if delta != tally:
        failures.append(f"the server counted {delta}, the client {tally}")
    return failures


def run(url: str, args: argparse.Namespace) -> list[str]:
    with urllib.request.urlopen(url + "/v1/models", timeout=60) as r:
        model = json.loads(r.read())["data"][0]["id"]
    return fuzz(url, model, args.bodies, args.seed)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--url", help="a running server")
    where.add_argument("--serve", help="a serve command to start on a free loopback port (e.g. \"serve --router router.pt\")")
    ap.add_argument("--bodies", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=61)
    args = ap.parse_args(argv)
    if args.serve:
        with serving(args.serve) as (url, _):
            failures = run(url, args)
    else:
        url, failures = args.url, run(args.url, args)
    for f in failures[:20]:
        print("FAIL", f)
    print(f"{args.bodies} fuzzed bodies beside valid neighbours at {url}: "
          + ("no 5xx, neighbours unchanged, counters equal the client tally" if not failures else f"{len(failures)} failures"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
