"""Where a decode step's time goes on the CPU kernels: the Linear and attention kernels against the
rest of the forward (Python, the modules, norms, rotary, cache writes, the head's glue).

Loads a model at ``--weights`` (fp32, int8 or q4) with Choral's CPU kernels, prefills a prompt into
a static cache, then times ``--steps`` forwards of each width in ``--tokens`` (1 = a decode step,
5 = a verify of K=4). ``--paths lean,hf`` runs each step through the lean forward and through the
Hugging Face forward on the same kernels, one after the other (each with its own cache), so that
the two are compared under the same machine state. Each call into a Linear or attention kernel is
timed on its own (``time.perf_counter`` around it), so the report splits every step into: Linear
kernels (by kind), attention, and everything else (the lean forward's C++ RMSNorm, rotary and SiLU
calls included). Writes ``profile.json`` under ``--out`` and prints a table.

    python scripts/experiments/profile_step.py --model qwen2.5-coder-1.5b-instruct --weights q4 --out runs/profile-q4
    # ... and where a 109-token prefill's time goes (fp32 prefills run on F.linear: "other")
    python scripts/experiments/profile_step.py --weights q4 --prefill 109 --prefill-repeats 3 --tokens 1 --steps 5
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from serving.engine import cpu_kernels  # noqa: E402
from serving.engine.engine_settings import EngineSettings
from serving.engine.loader import load_models, prepare_kernels
from serving.engine.runner import ModelRunner  # noqa: E402

KERNEL_NAMES = ("rowdot_linear", "rowdot_linear_w8a8", "rowdot_linear_w4a8", "rowdot_attention")


class KernelClock:
    """Wraps the extension's functions: seconds spent in each, since the last ``reset``."""

    def __init__(self) -> None:
        self.ext = cpu_kernels._rowdot_ext()
        self.spent: dict[str, float] = collections.defaultdict(float)
        for name in KERNEL_NAMES:
            self._wrap(name, getattr(self.ext, name))

    def _wrap(self, name, fn):
        def timed(*args):
            t0 = time.perf_counter()
            out = fn(*args)
            self.spent[name] += time.perf_counter() - t0
            return out

        setattr(self.ext, name, timed)

    def reset(self) -> None:
        self.spent.clear()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--weights", default="q4", choices=cpu_kernels.WEIGHTS)
    p.add_argument("--as-draft", action="store_true",
                   help="prepare the model as a draft (draft_weights=--weights: q4 rounds every Linear into 4-bit groups)")
    p.add_argument("--tokens", default="1,5", help="step widths to profile")
    p.add_argument("--batch-rows", default="1",
                   help="rows stepped together, each with its own cache row (1,4,8: a server's batch): every width runs at "
                        "every row count. train-router step_profile= reads the result as the verify cost under load")
    p.add_argument("--prefill", type=int, default=100, help="prompt tokens in the cache before the steps")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--paths", default="lean",
                   help="forwards to time, interleaved step by step: lean (serving.engine.decoder), hf "
                        "(the Hugging Face forward on the same kernels), or lean,hf")
    p.add_argument("--prefill-repeats", type=int, default=0,
                   help="also time this many prefills of --prefill tokens (the median is reported as a row)")
    p.add_argument("--out", default="runs/profile-step")
    args = p.parse_args(argv)
    if args.prefill_repeats < 0:
        p.error(f"--prefill-repeats {args.prefill_repeats} must be >= 0")
    widths = [int(t) for t in args.tokens.split(",")]
    batch_rows = [int(b) for b in args.batch_rows.split(",")]
    if min(batch_rows) < 1:
        p.error(f"--batch-rows {args.batch_rows} must be positive row counts")
    paths = args.paths.split(",")

    settings = EngineSettings(**{"draft_weights" if args.as_draft else "target_weights": args.weights})
    tok, model, _ = load_models(settings, args.model)
    prepare_kernels(settings, [] if args.as_draft else [model], [model] if args.as_draft else [], widths)
    clock = KernelClock()
    high = min(20000, model.config.vocab_size)  # token ids change no cost; a tiny test model has few
    low = high // 200
    lean = getattr(model, "_choral_decoder", None)
    if lean is None and "lean" in paths:
        raise SystemExit(f"{args.model} has no lean forward (serving.engine.decoder); use --paths hf")
    runners = {}
    for path in paths:  # one cache per path, both prefilled with the same prompt
        runners[path] = ModelRunner(model, batch_size=max(batch_rows), max_len=args.prefill + (args.steps + 2) * max(widths))
        if lean is not None:
            lean.enabled = path == "lean"
        prompt = torch.randint(low, high, (1, args.prefill), generator=torch.Generator().manual_seed(0))
        for slot in range(max(batch_rows)):  # every row's cache holds the prompt
            runners[path].prefill(prompt, slot=slot)
    rows = []
    for path in paths if args.prefill_repeats else ():  # whole prompts: the prefill's own split
        if lean is not None:
            lean.enabled = path == "lean"
        timed = []
        for i in range(args.prefill_repeats + 1):  # one untimed warm-up
            prompt = torch.randint(low, high, (1, args.prefill), generator=torch.Generator().manual_seed(100 + i))
            clock.reset()
            t0 = time.perf_counter()
            runners[path].prefill(prompt, slot=0)
            if i:
                timed.append((time.perf_counter() - t0, dict(clock.spent)))
        total, spent = sorted(timed, key=lambda x: x[0])[len(timed) // 2]
        med = {name: spent.get(name, 0.0) * 1e3 for name in KERNEL_NAMES}
        rows.append({"path": path, "tokens": f"prefill {args.prefill}", "step_ms": total * 1e3, "kernels_ms": med,
                     "other_ms": total * 1e3 - sum(med.values())})
        runners[path].prefill(torch.randint(low, high, (1, args.prefill), generator=torch.Generator().manual_seed(0)), slot=0)
    for b, width in [(b, w) for b in batch_rows for w in widths]:
        pos = args.prefill  # every (rows, width) at the same context: the cache past it is rewritten
        totals = {path: [] for path in paths}
        parts = {path: collections.defaultdict(list) for path in paths}
        for step in range(args.steps + 2):  # two untimed warm-up steps
            tokens = torch.randint(low, high, (b, width))  # [B, T]
            positions = torch.arange(pos, pos + width).repeat(b, 1)  # [B, T]
            pos += width
            for path in paths:  # the same step on each path, one after the other
                if lean is not None:
                    lean.enabled = path == "lean"
                clock.reset()
                t0 = time.perf_counter()
                runners[path].forward(tokens, positions)
                total = time.perf_counter() - t0
                if step < 2:
                    continue
                totals[path].append(total)
                for name in KERNEL_NAMES:
                    parts[path][name].append(clock.spent.get(name, 0.0))
        for path in paths:
            med = {name: statistics.median(v) * 1e3 for name, v in parts[path].items()}
            total_ms = statistics.median(totals[path]) * 1e3
            rows.append({"path": path, "batch_rows": b, "tokens": width, "step_ms": total_ms, "kernels_ms": med,
                         "other_ms": total_ms - sum(med.values())})
    record = {
        "command": " ".join(["python", *sys.argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__},
        "model": args.model, "weights": args.weights, "as_draft": args.as_draft, "prefill": args.prefill, "steps": args.steps,
        "batch_rows": batch_rows, "rows": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.json").write_text(json.dumps(record, indent=2))
    print(f"| forward | rows | tokens | step ms | {' | '.join(KERNEL_NAMES)} | other ms |")
    print("|---|---|---|---|" + "---|" * len(KERNEL_NAMES) + "---|")
    for r in rows:
        cells = " | ".join(f"{r['kernels_ms'].get(n, 0.0):.1f}" for n in KERNEL_NAMES)
        print(f"| {r['path']} | {r.get('batch_rows', 1)} | {r['tokens']} | {r['step_ms']:.1f} | {cells} | {r['other_ms']:.1f} |")
    return record


if __name__ == "__main__":
    main()
