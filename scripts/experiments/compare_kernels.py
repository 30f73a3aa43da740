"""One integer Linear kernel (or the attention kernel) at two git revisions, timed call by call in
one process (CPU).

A kernel change is often worth 10-20%, while this kind of VM drifts by more than that between two
runs of a benchmark. Here the kernel of revision REV (its `cpu_kernels.py` and `rowdot.cpp`,
taken with `git show` and built as an extension of their own) and the working tree's alternate
call by call on the same weights and inputs, so both see the same machine; the medians are
compared. Each side converts the Linear with its own `Q4Linear` / `Int8Linear`, so a change of
weight layout is compared too.

    python scripts/experiments/compare_kernels.py --rev HEAD~1 --linear 1536x8960 --weights q4 --tokens 1,5,9,128
    # where the CPU has AMX: the working tree's kernel on the vector units against AMX, call by call
    python scripts/experiments/compare_kernels.py --amx-vs-vector --linear 8960x1536 --tokens 5,16,32,128
    # the verify's attention (query heads x key-value heads x head size, over --context cached keys)
    python scripts/experiments/compare_kernels.py --rev HEAD~1 --attention 12x2x128 --context 300 --tokens 1,5,16 --copies 28

Prints a markdown table and writes JSON (default runs/compare_kernels.json).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from serving.engine import cpu_kernels  # noqa: E402

FILES = ("cpu_kernels.py", "rowdot.cpp")


def kernels_at(rev: str, into: Path):
    """The `cpu_kernels` module of revision ``rev``, loaded under a name of its own (its C++ is
    built from its own `rowdot.cpp`: the extension's name carries a hash of the source)."""
    for name in FILES:
        try:
            text = subprocess.run(["git", "show", f"{rev}:serving/engine/{name}"], cwd=ROOT, check=True,
                                  capture_output=True, text=True).stdout
        except subprocess.CalledProcessError as e:
            raise SystemExit(f"compare_kernels: git show {rev}:serving/engine/{name} failed: {e.stderr.strip()}; "
                             "give --rev a commit of this repository") from e
        (into / name).write_text(text)
    spec = importlib.util.spec_from_file_location("choral_cpu_kernels_at_rev", into / "cpu_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    if mod._rowdot_ext() is None:
        raise SystemExit(f"compare_kernels: the kernel of {rev} does not build here")
    return mod


def convert(mod, lin: nn.Linear, weights: str) -> nn.Module:
    if weights == "q4":
        return mod.Q4Linear(lin, mod.q4_lattice(lin.weight))
    return mod.Int8Linear(lin)


def amx_and_vector(lins: list[nn.Linear], weights: str) -> dict:
    """The working tree's layers twice: AMX turned off just before each call, and on."""
    ext = cpu_kernels._rowdot_ext()
    if not ext.rowdot_amx(1):
        raise SystemExit("compare_kernels: --amx-vs-vector: this CPU (or its kernel) has no AMX")
    mods = [convert(cpu_kernels, lin, weights) for lin in lins]

    def with_amx(flag: int):
        return [lambda x, m=m: (ext.rowdot_amx(flag), m(x))[1] for m in mods]

    return {"vector": with_amx(0), "AMX": with_amx(1)}


def attention_sides(mods: dict, shape: str, context: int, copies: int, most_rows: int) -> tuple[dict, Callable]:
    """Each revision's ``rowdot_attention`` over ``copies`` caches of ``context`` keys (one per layer
    of a model, so that a call reads its keys and values from beyond the caches as a step does),
    and the inputs of a call of t query rows: (q [1, t, H, D], mask [1, t, S])."""
    try:
        H, Hkv, D = (int(v) for v in shape.lower().split("x"))
    except ValueError:
        raise SystemExit(f"compare_kernels: --attention {shape!r}: give HEADSxKV_HEADSxHEAD_SIZE, e.g. 12x2x128")
    if min(H, Hkv, D) < 1 or H % Hkv:
        raise SystemExit(f"compare_kernels: --attention {shape!r}: the query heads must be a multiple of the key-value heads")
    S = context + most_rows  # room for the step's own rows, as a cache holds
    caches = [(torch.randn(1, Hkv, S, D), torch.randn(1, Hkv, S, D)) for _ in range(copies)]
    sides = {name: [lambda inp, ext=mod._rowdot_ext(), k=k, v=v: ext.rowdot_attention(inp[0], k, v, inp[1], D ** -0.5)
                    for k, v in caches] for name, mod in mods.items()}  # fmt: skip

    def inputs(t: int):
        mask = torch.zeros(1, t, S, dtype=torch.bool)
        for i in range(t):
            mask[0, i, : context + i + 1] = True  # the cached keys and the step's rows up to its own
        return torch.randn(1, t, H, D), mask

    return sides, inputs


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rev", default="HEAD", help="the git revision to compare the working tree with")
    p.add_argument("--linear", default="8960x1536", help="OUTxIN: one Linear(IN, OUT)")
    p.add_argument("--weights", default="q4", choices=("q4", "int8"))
    p.add_argument("--tokens", default="1,5,9,128", help="rows per call")
    p.add_argument("--calls", type=int, default=300, help="timed calls per side, divided by the rows (at least 10)")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--copies", type=int, default=1, help="Linears of the shape (different weights), called in turn: "
                   "enough of them to exceed the last-level cache makes every call read its weights from memory, "
                   "as a model step does (one Linear of a 1.5B model stays in a 32 MB L3)")
    p.add_argument("--no-amx", action="store_true", help="both sides on the vector units where the CPU has AMX")
    p.add_argument("--amx-vs-vector", action="store_true",
                   help="instead of two revisions: the working tree's kernel on the vector units against AMX")
    p.add_argument("--attention", default=None, metavar="HxKVxD",
                   help="instead of a Linear: rowdot_attention with H query heads, KV key-value heads of size D")
    p.add_argument("--context", type=int, default=300, help="with --attention: cached keys before the step's rows")
    p.add_argument("--json", default="runs/compare_kernels.json")
    args = p.parse_args(argv)
    try:
        out_f, in_f = (int(v) for v in args.linear.lower().split("x"))
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        raise SystemExit(f"compare_kernels: --linear {args.linear!r} --tokens {args.tokens!r}: "
                         "give --linear as OUTxIN (e.g. 8960x1536) and --tokens as a comma list (e.g. 1,5,128)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if cpu_kernels._rowdot_ext() is None:
        raise SystemExit("compare_kernels: the working tree's kernel does not build here")
    if args.no_amx and args.amx_vs_vector:
        raise SystemExit("compare_kernels: --no-amx and --amx-vs-vector exclude each other; give one")
    if args.copies < 1:
        raise SystemExit(f"compare_kernels: --copies {args.copies} must be >= 1")
    torch.manual_seed(0)
    lins = [] if args.attention else [nn.Linear(in_f, out_f, bias=False) for _ in range(args.copies)]
    if args.weights == "q4":
        with torch.no_grad():
            for lin in lins:
                lin.weight.copy_(cpu_kernels.snap_to_q4_lattice(lin.weight))
    with tempfile.TemporaryDirectory() as tmp:
        make_input = lambda t: torch.randn(t, in_f)  # noqa: E731
        if args.attention:
            if args.no_amx or args.amx_vs_vector:
                raise SystemExit("compare_kernels: --attention runs on the vector units only; drop --no-amx / --amx-vs-vector")
            sides, make_input = attention_sides({args.rev: kernels_at(args.rev, Path(tmp)), "working tree": cpu_kernels},
                                                args.attention, args.context, args.copies, max(tokens))  # fmt: skip
        elif args.amx_vs_vector:
            sides = amx_and_vector(lins, args.weights)
        else:
            old = kernels_at(args.rev, Path(tmp))
            if args.no_amx:
                for mod in (old, cpu_kernels):
                    if hasattr(mod._rowdot_ext(), "rowdot_amx"):
                        mod._rowdot_ext().rowdot_amx(0)
            sides = {args.rev: [convert(old, lin, args.weights) for lin in lins],
                     "working tree": [convert(cpu_kernels, lin, args.weights) for lin in lins]}
        rows = []
        with torch.no_grad():
            for t in tokens:
                x = make_input(t)
                diff = 0.0
                for a, b in zip(*sides.values()):  # also the first calls' one-off costs
                    ya, yb = a(x), b(x)
                    diff = max(diff, float((ya - yb).abs().max() / ya.abs().max().clamp_min(1e-30)))
                times = {name: [] for name in sides}
                for i in range(max(10, args.calls // t)):
                    for name, ms in sides.items():
                        m = ms[i % args.copies]
                        t0 = time.perf_counter()
                        m(x)
                        times[name].append(time.perf_counter() - t0)
                med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
                rows.append({"tokens": t, "ms": med, "calls": len(next(iter(times.values()))), "max_rel_diff": diff})
    names = list(sides)
    what = f"attention {args.attention}, {args.context} keys" if args.attention else f"{args.weights} {out_f}x{in_f}"
    print(f"| {what} | tokens | {names[0]} ms | {names[1]} ms | {names[0]} / {names[1]} | max rel diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        a, b = (r["ms"][n] for n in names)
        print(f"| | {r['tokens']} | {a:.3f} | {b:.3f} | {a / b:.2f}x | {r['max_rel_diff']:.1e} |")
    result = {"rev": "AMX against the vector units" if args.amx_vs_vector else args.rev, "weights": args.weights, "shape": [out_f, in_f],
              "attention": args.attention, "context": args.context if args.attention else None, "copies": args.copies,
              "threads": torch.get_num_threads(), "amx": not args.no_amx,
              "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "rows": rows}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
