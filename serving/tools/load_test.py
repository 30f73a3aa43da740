"""Load test for `serve`: N concurrent streaming clients against a local server.

    python scripts/load_test.py --url http://127.0.0.1:8000 --concurrency 8 --requests 64 \\
        --max-tokens 64 --compare-sequential --out runs/load

Each client sends streaming requests (chat for prompts that use the chat template, completions
otherwise; greedy unless --temperature) until --requests have been sent or --duration seconds
have passed, whichever comes first. Reported (JSON and markdown in --out):

* throughput: completion tokens / wall time of the run, and requests / s;
* TTFT (request sent -> first text), inter-token latency (per request: decode time / (tokens - 1),
  since a speculative step delivers several tokens in one chunk), end-to-end latency: p50/p90/p99;
* errors: HTTP errors, broken streams, and malformed responses (no finish_reason, no usage, no
  ``choral`` statistics) are all counted; a lost response is an error too;
* per request: prompt and completion tokens, the draft used and its acceptance rate.

``--compare-sequential`` then sends the same requests one at a time (concurrency 1) and reports
the ratio of aggregate tokens/s. Only loopback URLs are accepted: this is a benchmark of a local
server, not a tool to load someone else's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import openai
from tqdm import tqdm

from serving.prompts import DOMAINS, Prompt, load_prompts, read_prompt_file

LOOPBACK = {"127.0.0.1", "localhost", "::1"}


@dataclass
class Row:
    index: int
    prompt_id: str
    ok: bool = False
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    draft: str | None = None
    acceptance: float | None = None
    tokens_per_target_call: float | None = None
    ttft_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None
    text: str = field(default="", repr=False)


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    xs = sorted(values)

    def pct(p: float) -> float:  # linear interpolation, as numpy's default
        pos = (len(xs) - 1) * p
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    return {"p50": pct(0.5), "p90": pct(0.9), "p99": pct(0.99), "mean": sum(xs) / len(xs)}


async def one_request(client: openai.AsyncOpenAI, model: str, prompt: Prompt, index: int, args: argparse.Namespace) -> Row:
    row = Row(index, prompt.id)
    common = dict(model=model, max_tokens=args.max_tokens, temperature=args.temperature, stream=True,
                  stream_options={"include_usage": True})  # fmt: skip
    if args.seed is not None:
        common["seed"] = args.seed + index
    if args.draft:
        drafters = args.draft.split(",")  # a mixed load: request i gets the (i mod n)-th
        common["extra_body"] = {"draft": drafters[index % len(drafters)].strip()}
    chat = prompt.use_chat_template
    start = time.perf_counter()
    first = last = None
    finish = usage = choral = None
    parts: list[str] = []
    try:
        if chat:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt.text}], **common)
        else:
            stream = await client.completions.create(prompt=prompt.text, **common)
        async for chunk in stream:
            now = time.perf_counter()
            extra = chunk.model_extra or {}
            choral = extra.get("choral", choral)
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text = (choice.delta.content if chat else choice.text) or ""
                if text:
                    first = first or now
                    last = now
                    parts.append(text)
                finish = choice.finish_reason or finish
    except openai.APIStatusError as e:
        row.error = f"HTTP {e.status_code}: {e.message}"
        return row
    except (openai.APIError, OSError) as e:
        row.error = f"{type(e).__name__}: {e}"
        return row
    end = time.perf_counter()
    row.text = "".join(parts)
    problems = [what for what, missing in (("finish_reason", finish is None), ("usage", usage is None),
                                           ("choral", choral is None)) if missing]  # fmt: skip
    if problems:
        row.error = f"malformed response: no {', '.join(problems)}"
        return row
    row.ok = True
    row.finish_reason = finish
    row.prompt_tokens, row.completion_tokens = usage.prompt_tokens, usage.completion_tokens
    row.draft, row.acceptance = choral.get("draft"), choral.get("acceptance_rate")
    row.tokens_per_target_call = choral.get("tokens_per_target_call")
    row.e2e_ms = 1e3 * (end - start)
    if first is not None:
        row.ttft_ms = 1e3 * (first - start)
        if row.completion_tokens > 1:
            row.itl_ms = 1e3 * (last - first) / (row.completion_tokens - 1)
    return row


async def run(base_url: str, model: str, prompts: list[Prompt], args: argparse.Namespace, concurrency: int,
              n_requests: int, label: str) -> dict:  # fmt: skip
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=args.timeout)
    rows: list[Row] = []
    next_index = 0
    deadline = time.perf_counter() + args.duration if args.duration else None
    bar = tqdm(total=n_requests, desc=f"{label} (concurrency {concurrency})", unit="req", disable=args.quiet)

    async def worker() -> None:
        nonlocal next_index
        while next_index < n_requests and (deadline is None or time.perf_counter() < deadline):
            i = next_index
            next_index += 1
            rows.append(await one_request(client, model, prompts[i % len(prompts)], i, args))
            bar.update(1)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    bar.close()
    await client.close()
    rows.sort(key=lambda r: r.index)
    good = [r for r in rows if r.ok]
    tokens = sum(r.completion_tokens for r in good)
    errors: dict[str, int] = {}
    for r in rows:
        if not r.ok:
            errors[r.error.split(":")[0]] = errors.get(r.error.split(":")[0], 0) + 1
    return {
        "label": label,
        "concurrency": concurrency,
        "n_requests": len(rows),
        "n_ok": len(good),
        "errors": len(rows) - len(good),
        "error_kinds": errors,
        "error_examples": sorted({r.error for r in rows if not r.ok})[:5],
        "wall_s": wall,
        "completion_tokens": tokens,
        "throughput_tokens_per_s": tokens / wall if wall else 0.0,
        "requests_per_s": len(good) / wall if wall else 0.0,
        "ttft_ms": percentiles([r.ttft_ms for r in good if r.ttft_ms is not None]),
        "itl_ms": percentiles([r.itl_ms for r in good if r.itl_ms is not None]),
        "e2e_ms": percentiles([r.e2e_ms for r in good]),
        "rows": [asdict(r) for r in rows],
    }


def markdown(report: dict) -> str:
    runs = [report] + ([report["sequential"]] if "sequential" in report else [])

    def ms(d: dict, key: str) -> str:
        v = d[key]
        return " / ".join("-" if v[p] is None else f"{v[p]:.1f}" for p in ("p50", "p90", "p99"))

    lines = [
        f"# Load test: {report['model']} at {report['url']}",
        "",
        f"max_tokens {report['settings']['max_tokens']}, temperature {report['settings']['temperature']}, "
        f"{len(report['settings']['prompts'])} distinct prompts",
        "",
        "| run | concurrency | requests | errors | tokens/s | requests/s | TTFT ms p50/p90/p99 | ITL ms p50/p90/p99 | e2e ms p50/p90/p99 |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {r['label']} | {r['concurrency']} | {r['n_requests']} | {r['errors']} | {r['throughput_tokens_per_s']:.1f} "
            f"| {r['requests_per_s']:.2f} | {ms(r, 'ttft_ms')} | {ms(r, 'itl_ms')} | {ms(r, 'e2e_ms')} |"
        )
    if "speedup_vs_sequential" in report:
        lines += ["", f"Aggregate tokens/s, concurrent vs one at a time: **{report['speedup_vs_sequential']:.2f}x**"]
    drafts: dict[str, list[float]] = {}
    for row in report["rows"]:
        if row["ok"]:
            drafts.setdefault(row["draft"], []).append(row["acceptance"] or 0.0)
    if drafts:
        lines += ["", "| draft | requests | mean acceptance |", "|---|---|---|"]
        lines += [f"| {d} | {len(a)} | {sum(a) / len(a):.3f} |" for d, a in sorted(drafts.items())]
    return "\n".join(lines) + "\n"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def load_request_prompts(args: argparse.Namespace) -> list[Prompt]:
    if args.prompt_file:
        prompts = read_prompt_file(args.prompt_file)
    elif args.families:  # the routing workload: n prompts of each family from one split, interleaved
        from serving.workload import FAMILIES, load_family

        names = list(FAMILIES) if args.families == "all" else [f.strip() for f in args.families.split(",")]
        per = [load_family(f, args.split, args.n_prompts) for f in names]
        prompts = [p for group in zip(*per) for p in group]
    else:
        prompts = [p for d in args.domains.split(",") for p in load_prompts(d.strip(), args.n_prompts)]
    if args.max_prompt_chars:
        prompts = [p for p in prompts if len(p.text) <= args.max_prompt_chars]
    if not prompts:
        raise ValueError("no prompts left: give --prompt-file or raise --max-prompt-chars")
    return prompts


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    ap.add_argument("--model", help="model id; default: the first of /v1/models")
    ap.add_argument("--concurrency", type=int, default=8, help="clients sending at the same time")
    ap.add_argument("--requests", type=int, default=64, help="requests to send in all")
    ap.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--seed", type=int, default=None, help="seed of request i is seed + i")
    ap.add_argument("--draft", default=None,
                    help="force this drafter (or none) on every request; a comma list (base,ngram,none) gives request i "
                         "the (i mod n)-th: a mixed load, the same requests on every server")
    ap.add_argument("--prompt-file", help=".txt or .jsonl prompts (see serving.prompts.read_prompt_file)")
    ap.add_argument("--domains", default=",".join(DOMAINS), help=f"built-in prompt domains ({', '.join(DOMAINS)})")
    ap.add_argument("--families", default=None, help="routing-workload families instead of --domains (comma list, or all)")
    ap.add_argument("--split", default="test", choices=["train", "val", "test"], help="the workload split of --families")
    ap.add_argument("--n-prompts", type=int, default=16, help="prompts per built-in domain")
    ap.add_argument("--max-prompt-chars", type=int, default=None, help="skip longer prompts")
    ap.add_argument("--compare-sequential", action="store_true", help="then send the same requests one at a time")
    ap.add_argument("--timeout", type=float, default=600.0, help="client timeout per request (s)")
    ap.add_argument("--out", default="runs/load", help="folder for load_test.json and load_test.md")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--profile", metavar="PATH",
                    help="also write a simulator profile (YAML/JSON): this run's lengths, domain mix and acceptance "
                         "on the costs of --profile-base (serving.fleet.profile.from_load_test)")
    ap.add_argument("--profile-base", metavar="PATH", help="profile with the target and draft costs (e.g. from spec-bench --profile)")
    return ap


async def amain(args: argparse.Namespace) -> dict:
    parsed = urlparse(args.url)
    if parsed.hostname not in LOOPBACK:
        raise ValueError(f"--url {args.url!r}: only loopback servers (127.0.0.1, localhost, ::1) may be load-tested")
    if args.concurrency < 1 or args.requests < 1:
        raise ValueError("--concurrency and --requests must be >= 1")
    base_url = args.url.rstrip("/") + "/v1"
    prompts = load_request_prompts(args)
    model = args.model
    if model is None:
        async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
            model = (await client.models.list()).data[0].id
    report = await run(base_url, model, prompts, args, args.concurrency, args.requests, "concurrent")
    report.update(url=args.url, model=model,
                  settings={"max_tokens": args.max_tokens, "temperature": args.temperature, "duration": args.duration,
                            "prompts": [p.id for p in prompts]})  # fmt: skip
    if args.compare_sequential:
        # The same requests as the concurrent run actually sent, so both runs do the same work.
        args.duration = None
        seq = await run(base_url, model, prompts, args, 1, report["n_requests"], "sequential")
        report["sequential"] = seq
        report["speedup_vs_sequential"] = (
            report["throughput_tokens_per_s"] / seq["throughput_tokens_per_s"] if seq["throughput_tokens_per_s"] else 0.0
        )
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = asyncio.run(amain(args))
    except (ValueError, FileNotFoundError, openai.APIConnectionError) as e:
        print(f"load_test: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(out / "load_test.json", json.dumps(report, indent=2))
    md = markdown(report)
    write_atomic(out / "load_test.md", md)
    print(md)
    if args.profile:
        from serving.fleet.profile import from_load_test, load_profile

        try:
            base = load_profile(args.profile_base) if args.profile_base else None
            from_load_test(report, base=base).save(args.profile)
        except (ValueError, FileNotFoundError) as e:
            print(f"load_test: error: cannot write the profile: {e}", file=sys.stderr)
            return 2
        print(f"simulator profile in {args.profile}")
    return 0 if report["errors"] == 0 and report.get("sequential", {}).get("errors", 0) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
