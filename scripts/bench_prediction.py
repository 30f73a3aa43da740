"""Predicted Outputs through the official ``openai`` client: code-edit requests with and without a
``prediction`` (the original code), against a live ``serve`` on the bundled pair.

    python scripts/bench_prediction.py --n 2 --max-tokens 96 --out runs/prediction
    python scripts/bench_prediction.py --n 4 --max-tokens 160 --k-buckets 1,2,3,4,5,6,7,8,12,15 --prediction-k 15

Each request of the ``edit`` prompt family (serving.prompts) runs three ways, greedy: with
``prediction={"type": "content", "content": <the code being edited>}``, without it (routed: the
server's default drafter), and with the target alone (``draft: none``). Every path runs once
untimed (8 tokens), then ``--rounds`` timed runs interleaved; the best of each is kept. Prints a
markdown table and writes ``prediction.json`` (command, date, machine, every row).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

from serving.engine.devices import describe_machine
from serving.prompts import load_grounded
from serving.server.launch import free_port, stop, wait_healthy

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"


def ask(client, model: str, text: str, max_tokens: int, extra: dict) -> tuple[str, float, dict, int]:
    started = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], max_tokens=max_tokens,
                                       temperature=0, **extra)  # fmt: skip
    return r.choices[0].message.content, time.perf_counter() - started, (r.model_extra or {}).get("choral", {}), r.usage.completion_tokens


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=4, help="edit prompts (the first n of the family: one per kind of edit for n=4)")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--k", default="8", help="engine.k: the most tokens a step drafts, or auto (per request, "
                                             "Hugging Face's heuristic over --k-buckets)")
    ap.add_argument("--k-buckets", default=None, help="engine.k_buckets, a comma list (default: the server's)")
    ap.add_argument("--prediction-k", type=int, default=None, help="engine.prediction.k: the most tokens a prediction "
                    "proposes per step (a prediction costs no draft steps); default: the engine's k")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--target-weights", default="fp32", choices=["fp32", "int8", "q4"],
                    help="engine.target_weights of the server (CPU kernels)")
    ap.add_argument("--out", default="runs/prediction")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from openai import OpenAI

    from routing.router import Router

    router = out / "router.pt"  # untrained: this benchmark forces or predicts every drafter
    Router.create({"base": DRAFT}, TARGET).save(router)
    port = free_port()
    cmd = ["serve", "--router", str(router), "--port", str(port), "engine.max_len=2048", "engine.max_batch_size=1",
           f"engine.k={args.k}", f"engine.target_weights={args.target_weights}"]  # fmt: skip
    if args.k_buckets:
        cmd.append(f"engine.k_buckets=[{args.k_buckets}]")
    if args.prediction_k:
        cmd.append(f"engine.prediction.k={args.prediction_k}")
    print("$", " ".join(cmd), flush=True)
    with open(out / "serve.log", "w") as log:
        server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    rows = []
    try:
        wait_healthy(f"http://127.0.0.1:{port}", server, timeout_s=900, poll_s=2.0)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=900)
        model = client.models.list().data[0].id
        for g in load_grounded("edit", args.n):
            paths = {
                "prediction": {"prediction": {"type": "content", "content": g.source}},
                "routed": {},
                "target alone": {"extra_body": {"draft": "none"}},
            }
            for extra in paths.values():
                ask(client, model, g.prompt.text, 8, extra)
            best: dict[str, tuple] = {}
            for _ in range(args.rounds):
                for name, extra in paths.items():
                    answer, seconds, choral, tokens = ask(client, model, g.prompt.text, args.max_tokens, extra)
                    if name not in best or seconds < best[name][1]:
                        best[name] = (answer, seconds, choral, tokens)
            row = {"id": g.prompt.id, "tokens": best["target alone"][3]}
            for name, (answer, seconds, choral, tokens) in best.items():
                row[name] = {"seconds": seconds, "tokens_per_s": tokens / seconds, "drafter": choral.get("draft"),
                             "acceptance": choral.get("acceptance_rate"), "identical": answer == best["target alone"][0],
                             "tokens_per_target_call": choral.get("tokens_per_target_call"),
                             "prefill_s": choral.get("prefill_s"), "decode_s": choral.get("draft_s", 0) + choral.get("verify_s", 0)}  # fmt: skip
            row["answer"] = best["target alone"][0]
            row["speedup_vs_routed"] = best["routed"][1] / best["prediction"][1]
            row["speedup_vs_target_alone"] = best["target alone"][1] / best["prediction"][1]
            # The steps after the prompt's prefill (which every path pays alike): draft + verify time.
            row["decode_speedup_vs_routed"] = row["routed"]["decode_s"] / max(row["prediction"]["decode_s"], 1e-9)
            rows.append(row)
            print(f"{row['id']}: prediction {row['speedup_vs_routed']:.2f}x over the same request without it "
                  f"({row['routed']['drafter']}), {row['speedup_vs_target_alone']:.2f}x over the target alone; "
                  f"identical: {row['prediction']['identical']}", flush=True)  # fmt: skip
    finally:
        stop([server])
    command = " ".join(["python", "scripts/bench_prediction.py", *(argv if argv is not None else sys.argv[1:])])
    record = {"command": command, "date": datetime.date.today().isoformat(), "machine": describe_machine(),
              "max_tokens": args.max_tokens, "k": args.k, "k_buckets": args.k_buckets,
              "prediction_k": args.prediction_k, "serve": cmd, "rows": rows}  # fmt: skip
    (out / "prediction.json").write_text(json.dumps(record, indent=1))
    lines = [f"`{command}` ({record['date']}, {record['machine']}); greedy, best of {args.rounds} per path.", "",
             "| prompt | tokens | with prediction tok/s | without (routed) tok/s | target alone tok/s | vs without | vs target alone "
             "| acceptance | tokens/target call | prefill s (prediction / without) | decode vs without | identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        p = r["prediction"]
        lines.append(f"| {r['id']} | {r['tokens']} | {p['tokens_per_s']:.2f} | {r['routed']['tokens_per_s']:.2f} | "
                     f"{r['target alone']['tokens_per_s']:.2f} | {r['speedup_vs_routed']:.2f}x | {r['speedup_vs_target_alone']:.2f}x | "
                     f"{p['acceptance'] or 0:.2f} | {p['tokens_per_target_call'] or 0:.2f} | "
                     f"{p['prefill_s'] or 0:.1f} / {r['routed']['prefill_s'] or 0:.1f} | {r['decode_speedup_vs_routed']:.2f}x "
                     f"| {'yes' if p['identical'] and r['routed']['identical'] else 'NO'} |")  # fmt: skip
    (out / "prediction.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
