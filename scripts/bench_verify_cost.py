"""How much does verifying N tokens in one forward cost, relative to one token? (CPU)

Times a forward step of 1 vs N tokens on top of a prefilled KV cache, with plain eager
`nn.Linear` and with `serving.cpu_kernels.prepare_for_cpu` kernels, A/B interleaved in the
same process (the prepared modules keep the original weight, so they switch back to eager
F.linear for the A side). Also checks batch invariance: are the logits of one N-token step
bitwise equal to those of N one-token steps?

    python scripts/bench_verify_cost.py --model qwen2.5-coder-1.5b-instruct
    python scripts/bench_verify_cost.py --linear 8960x1536          # one Linear(1536, 8960)

Prints a markdown table and writes JSON (default runs/verify_cost.json).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serving.cpu_kernels import KERNELS, PackedLinear, prepare_for_cpu, set_packed  # noqa: E402


def _cpu_times() -> tuple[int, int]:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v), v[3] + v[4]


def wait_quiet(min_idle: float, timeout: float = 60.0) -> float:
    """Wait until the CPUs are mostly idle (another user's job skews every timing)."""
    if min_idle <= 0 or not os.path.exists("/proc/stat"):
        return 1.0
    start = time.time()
    while True:
        a = _cpu_times()
        time.sleep(0.3)
        b = _cpu_times()
        idle = (b[1] - a[1]) / max(1, b[0] - a[0])
        if idle >= min_idle or time.time() - start > timeout:
            return idle


def machine() -> dict:
    cpu = platform.processor()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "isa": torch.backends.cpu.get_cpu_capability()}


def _md_table(rows: list[dict], counts: list[int], base_key: str) -> str:
    """Median ms per step, then cost relative to the path's own 1-token step and to eager's."""
    more = [n for n in counts if n > 1]
    head = ("| path | " + " | ".join(f"{n} tok ms" for n in counts) + " | "
            + " | ".join(f"{n}/own 1" for n in more) + " | " + " | ".join(f"{n}/eager 1" for n in counts) + " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    base = next(r for r in rows if r["path"] == base_key)["ms"]["1"]
    for r in rows:
        ms = r["ms"]
        lines.append(f"| {r['path']} | " + " | ".join(f"{ms[str(n)]:.1f}" for n in counts) + " | "
                     + " | ".join(f"{ms[str(n)] / ms['1']:.2f}" for n in more) + " | "
                     + " | ".join(f"{ms[str(n)] / base:.2f}" for n in counts) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------- one Linear


def bench_linear(args) -> dict:
    out_f, in_f = (int(v) for v in args.linear.lower().split("x"))
    # Rotate several copies so the weights do not sit in the (large) L3 cache, as in a real model.
    copies = max(1, min(8, int(400e6 // (out_f * in_f * 4))))
    torch.manual_seed(0)
    lins = [torch.nn.Linear(in_f, out_f, bias=args.bias) for _ in range(copies)]
    paths = {"eager": lins}
    for k in args.kernels:
        mods = [torch.nn.Sequential(torch.nn.Linear(in_f, out_f, bias=args.bias)) for _ in range(copies)]
        for m, src in zip(mods, lins):
            m[0].load_state_dict(src.state_dict())
            prepare_for_cpu(m, token_counts=args.tokens, kernel=k)
        paths[k] = mods
    counts = args.tokens
    xs = {n: torch.randn(n, in_f) for n in counts}
    times = {(p, n): [] for p in paths for n in counts}
    with torch.no_grad():
        invariance = {}
        big = torch.randn(max(counts), in_f)
        for p, mods in paths.items():
            full = mods[0](big)
            invariance[p] = {str(n): (mods[0](big[:n]) - full[:n]).abs().max().item() for n in counts}
            for n in counts:
                mods[0](xs[n])
        for rep in range(args.reps):
            wait_quiet(args.min_idle)
            order = list(paths) if rep % 2 == 0 else list(reversed(paths))
            for n in counts:
                for p in order:
                    t = time.perf_counter()
                    for m in paths[p]:
                        m(xs[n])
                    times[(p, n)].append((time.perf_counter() - t) / copies * 1e3)
    rows = [{"path": p, "ms": {str(n): statistics.median(times[(p, n)]) for n in counts},
             "max_abs_diff_vs_rows_of_largest": invariance[p]} for p in paths]
    print(f"\nLinear({in_f}, {out_f}) bias={args.bias}, median of {args.reps}, {copies} rotating copies\n")
    print(_md_table(rows, counts, "eager"))
    print("\nbatch invariance (max |y[n rows] - rows of y[max rows]|):")
    for r in rows:
        print(f"  {r['path']}: {r['max_abs_diff_vs_rows_of_largest']}")
    return {"kind": "linear", "shape": [out_f, in_f], "rows": rows}


# ---------------------------------------------------------------- whole model


def _load(args):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from serving.bundled import is_bundled_name, resolve_bundled

    path = resolve_bundled(args.model) if is_bundled_name(args.model) else args.model
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception:  # noqa: BLE001 - a folder without tokenizer still benchmarks
        tok = None
    return model, tok, str(path)


def _prompt_ids(tok, n: int, vocab: int) -> torch.Tensor:
    if tok is not None:
        text = Path(__file__).read_text()  # deterministic, code-like text
        ids = tok(text, return_tensors="pt").input_ids[:, :n]
        if ids.shape[1] == n:
            return ids
    return torch.randint(0, vocab, (1, n), generator=torch.Generator().manual_seed(0))


def _step(model, cache, ids):
    return model(input_ids=ids, past_key_values=cache, use_cache=True).logits[0]


def _invariance(model, cache, prefix_len, first_logits, n):
    """Logits of n greedy tokens fed one at a time vs all n in one step."""
    seq, logits1, tok = [], [], first_logits.argmax(-1).view(1, 1)
    for _ in range(n):
        seq.append(tok)
        lg = _step(model, cache, tok)[-1]
        logits1.append(lg)
        tok = lg.argmax(-1).view(1, 1)
    cache.crop(-n)
    logits_n = _step(model, cache, torch.cat(seq, dim=1))
    cache.crop(-n)
    logits1 = torch.stack(logits1)
    return {"bitwise_equal": bool(torch.equal(logits1, logits_n)),
            "max_abs_diff": (logits1 - logits_n).abs().max().item(),
            "argmax_equal": bool(torch.equal(logits1.argmax(-1), logits_n.argmax(-1)))}


def bench_model(args) -> dict:
    from transformers import DynamicCache

    counts = args.tokens
    rows, info = [], {}
    eager_rows = []
    for kernel in args.kernels:
        model, tok, path = _load(args)
        t = time.perf_counter()
        prepare_for_cpu(model, token_counts=counts, kernel=kernel)
        prep_s = time.perf_counter() - t
        packed_bytes = sum(m.packed_nbytes() for m in model.modules() if isinstance(m, PackedLinear))
        ids = _prompt_ids(tok, args.prefill, model.config.vocab_size)
        stream = torch.randint(0, model.config.vocab_size, (1, max(counts)),
                               generator=torch.Generator().manual_seed(1))
        times = {(m, n): [] for m in ("eager", kernel) for n in counts}
        with torch.no_grad():
            set_packed(model, False)
            cache = DynamicCache(config=model.config)
            first = _step(model, cache, ids)[-1]
            set_packed(model, True)
            inv = {}
            inv[kernel] = _invariance(model, cache, args.prefill, first, 5)
            set_packed(model, False)
            inv["eager"] = _invariance(model, cache, args.prefill, first, 5)
            for mode in ("eager", kernel):  # warm-up: first calls allocate and page weights in
                set_packed(model, mode != "eager")
                for n in counts:
                    _step(model, cache, stream[:, :n])
                    cache.crop(-n)
            for rep in range(args.reps):
                wait_quiet(args.min_idle)
                modes = ("eager", kernel) if rep % 2 == 0 else (kernel, "eager")
                for n in counts:
                    for mode in modes:
                        set_packed(model, mode != "eager")
                        t = time.perf_counter()
                        _step(model, cache, stream[:, :n])
                        times[(mode, n)].append((time.perf_counter() - t) * 1e3)
                        cache.crop(-n)
        for mode in ("eager", kernel):
            row = {"path": mode if mode == "eager" else f"prepared:{kernel}",
                   "ms": {str(n): statistics.median(times[(mode, n)]) for n in counts},
                   "ms_all": {str(n): times[(mode, n)] for n in counts},
                   "invariance_5": inv[mode]}
            (eager_rows if mode == "eager" else rows).append(row)
        info[kernel] = {"prepare_s": prep_s, "packed_bytes": packed_bytes}
        del model, cache
    # Each kernel run measured its own eager side; report the pooled eager medians once.
    pooled = {str(n): statistics.median([t for r in eager_rows for t in r["ms_all"][str(n)]]) for n in counts}
    rows.insert(0, {"path": "eager", "ms": pooled, "invariance_5": eager_rows[0]["invariance_5"]})
    print(f"\n{path}: forward of N tokens after a {args.prefill}-token prefill (DynamicCache, "
          f"cropped back each time), median of {args.reps} interleaved reps\n")
    print(_md_table(rows, counts, "eager"))
    print("\nbatch invariance, 5 greedy tokens one by one vs in one step:")
    for r in rows:
        print(f"  {r['path']}: {r['invariance_5']}")
    for k, v in info.items():
        print(f"  prepare({k}): {v['prepare_s']:.1f} s, packed weights {v['packed_bytes'] / 1e9:.2f} GB")
    return {"kind": "model", "model": path, "prefill": args.prefill, "rows": rows, "prepare": info}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder-1.5b-instruct",
                   help="bundled name, local folder or hub id")
    p.add_argument("--linear", metavar="OUTxIN", help="time one Linear(IN, OUT) instead of a model")
    p.add_argument("--bias", action="store_true", help="with --linear: give the Linear a bias")
    p.add_argument("--kernels", default="mkl", help=f"comma list from {','.join(KERNELS)}")
    p.add_argument("--tokens", default="1,2,3,5,9", help="tokens per step to time")
    p.add_argument("--prefill", type=int, default=128)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--min-idle", type=float, default=0.8,
                   help="before each rep wait (max 60 s) until this share of CPU is idle; 0 disables")
    p.add_argument("--json", default="runs/verify_cost.json")
    args = p.parse_args(argv)
    args.kernels = [k for k in args.kernels.split(",") if k]
    args.tokens = sorted({1, *(int(n) for n in args.tokens.split(","))})
    torch.set_num_threads(args.threads)
    result = bench_linear(args) if args.linear else bench_model(args)
    result.update(machine=machine(), argv=sys.argv[1:], when=time.strftime("%Y-%m-%d %H:%M:%S"))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
