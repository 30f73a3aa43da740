"""How fast this CPU can multiply int8 at all, and how close Choral's integer kernels come to it.

    python scripts/experiments/int8_peak.py --rows 1,5,16,64,256 --out runs/int8-peak

1. **The machine's peak**: a C loop of independent ``vpdpbusd`` (AVX-512 VNNI; 64 multiply-adds
   each) or ``vpmaddubsw`` + ``vpmaddwd`` (AVX2; 32 each) per thread, built with the system's
   compiler for this CPU, on ``--threads`` OpenMP threads; where the CPU has AMX, also a loop of
   independent ``tdpbsud`` tile products (16 x 16 x 64 each), the unit the int8 kernel uses for calls
   of more than one row.
2. **Choral's q4 and int8 kernels** (``serving.engine.cpu_kernels``) on the shapes of one layer
   of the bundled 1.5B target (fused q/k/v, o, fused gate/up, down), random weights, ``--rows``
   input rows per call: multiply-adds per second; where the int8 kernel runs on AMX, once more
   with AMX turned off (``int8-vnni``).
3. **What that means for a step**: the multiply-adds of one token through the whole target (every
   Linear, the head included) at the kernel rate, as a floor on a K+1-token verify's arithmetic.
   A one-token step reads about 1.1 GB of weights and is bound by memory instead; a verify
   can only cost about as much as one token if its arithmetic hides under that stream.

Writes ``int8_peak.json`` and ``int8_peak.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

LOOP = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
int main(int argc, char** argv) {
  long n = atol(argv[1]);
  double t0 = omp_get_wtime();
  long sink = 0;
#pragma omp parallel reduction(+ : sink)
  {
#if defined(__AVX512VNNI__)
    __m512i a[12], b = _mm512_set1_epi8(3), c = _mm512_set1_epi8(5);
    for (int i = 0; i < 12; ++i) a[i] = _mm512_setzero_si512();
    for (long k = 0; k < n; ++k) {
      for (int i = 0; i < 12; ++i) a[i] = _mm512_dpbusd_epi32(a[i], b, c);
      __asm__ volatile("" : "+v"(b), "+v"(c));
    }
    for (int i = 1; i < 12; ++i) a[0] = _mm512_add_epi32(a[0], a[i]);
    sink += _mm512_reduce_add_epi32(a[0]);
#else
    __m256i a[12], b = _mm256_set1_epi8(3), c = _mm256_set1_epi8(5), one = _mm256_set1_epi16(1);
    for (int i = 0; i < 12; ++i) a[i] = _mm256_setzero_si256();
    for (long k = 0; k < n; ++k) {
      for (int i = 0; i < 12; ++i) a[i] = _mm256_add_epi32(a[i], _mm256_madd_epi16(_mm256_maddubs_epi16(b, c), one));
      __asm__ volatile("" : "+v"(b), "+v"(c));
    }
    for (int i = 1; i < 12; ++i) a[0] = _mm256_add_epi32(a[0], a[i]);
    sink += _mm256_extract_epi32(a[0], 0);
#endif
  }
  double s = omp_get_wtime() - t0;
#if defined(__AVX512VNNI__)
  const char* isa = "avx512-vnni vpdpbusd";
  double macs = 12.0 * 64 * n;
#else
  const char* isa = "avx2 vpmaddubsw+vpmaddwd";
  double macs = 12.0 * 32 * n;
#endif
  printf("{\"isa\": \"%s\", \"threads\": %d, \"gmac_per_s\": %.2f, \"sink\": %ld}\n", isa, omp_get_max_threads(),
         macs * omp_get_max_threads() / s / 1e9, sink);
  return 0;
}
"""


def loop_peak(source: str, threads: int, iterations: int, optional: bool = False) -> dict:
    """Builds a C peak loop for this CPU, runs it three times on ``threads`` OpenMP threads and keeps
    the best; {} without a compiler. An ``optional`` loop (AMX) that does not build, fails or prints
    {} gives {} too; the vector units' loop raises instead."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp) / "peak.c", Path(tmp) / "peak"
        src.write_text(source)
        built = subprocess.run([cc, "-O2", "-march=native", "-fopenmp", str(src), "-o", str(exe)], capture_output=True,
                               text=True)  # fmt: skip
        if built.returncode != 0:
            if optional:
                print(f"the loop did not build: {built.stderr.strip()[-500:]}")
                return {}
            built.check_returncode()
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        runs = []
        for _ in range(3):
            done = subprocess.run([str(exe), str(iterations)], env=env, check=not optional, capture_output=True, text=True)
            if done.returncode != 0 or done.stdout.strip() in ("", "{}"):
                return {}
            runs.append(json.loads(done.stdout))
    best = max(runs, key=lambda r: r["gmac_per_s"])
    return {"isa": best["isa"], "threads": best["threads"], "gmac_per_s": best["gmac_per_s"],
            "runs": [r["gmac_per_s"] for r in runs]}  # fmt: skip


AMX_LOOP = r"""
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>
struct cfg { uint8_t palette, start, reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; } __attribute__((aligned(64)));
int main(int argc, char** argv) {
  long n = atol(argv[1]);
  if (syscall(SYS_arch_prctl, 0x1023, 18)) { printf("{}\n"); return 0; }  /* no tile state granted */
  static int8_t a[2][1024] __attribute__((aligned(64)));
  static uint8_t b[1024] __attribute__((aligned(64)));
  memset(a, 1, sizeof a), memset(b, 1, sizeof b);
  double t0 = omp_get_wtime();
#pragma omp parallel
  {
    struct cfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    __asm__ volatile("" : : "r"(&c) : "memory");  /* else gcc 12 drops the stores above as dead */
    _tile_loadconfig(&c);
    _tile_loadd(0, a[0], 64); _tile_loadd(1, a[1], 64); _tile_loadd(2, b, 64);
    _tile_zero(3); _tile_zero(4); _tile_zero(5); _tile_zero(6);
    for (long k = 0; k < n; ++k) {  /* four independent accumulators */
      _tile_dpbsud(3, 0, 2); _tile_dpbsud(4, 1, 2); _tile_dpbsud(5, 0, 2); _tile_dpbsud(6, 1, 2);
    }
    _tile_release();
  }
  double s = omp_get_wtime() - t0;
  printf("{\"isa\": \"amx tdpbsud\", \"threads\": %d, \"gmac_per_s\": %.2f}\n", omp_get_max_threads(),
         4.0 * 16 * 16 * 64 * n * omp_get_max_threads() / s / 1e9);
  return 0;
}
"""


def layer_shapes(hidden: int, heads: int, kv_heads: int, intermediate: int) -> list[tuple[str, int, int]]:
    """(name, out, in) of one decoder layer's Linears as the lean forward calls them (fused)."""
    d = hidden // heads
    return [("qkv", (heads + 2 * kv_heads) * d, hidden), ("o", hidden, hidden),
            ("gate_up", 2 * intermediate, hidden), ("down", hidden, intermediate)]  # fmt: skip


def make_layer(kind: str, out_f: int, in_f: int):
    from serving.engine.cpu_kernels import Int8Linear, Q4Linear

    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(in_f, out_f, bias=False)
    if kind == "int8":
        return Int8Linear(lin)
    q = torch.randint(0, 16, (out_f, in_f), dtype=torch.uint8, generator=g)
    step = torch.rand(out_f, in_f // 32, generator=g) * 0.01
    minimum = -torch.rand(out_f, in_f // 32, generator=g) * 0.05
    return Q4Linear(lin, (q, step, minimum))


def time_call(mod, rows: int, calls: int) -> float:
    x = torch.randn(rows, mod.in_features)
    for _ in range(2):
        mod(x)
    t0 = time.perf_counter()
    for _ in range(calls):
        mod(x)
    return (time.perf_counter() - t0) / calls


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,5,16,64,256", help="input rows per kernel call")
    ap.add_argument("--threads", type=int, default=0, help="threads (0: torch's default)")
    ap.add_argument("--iterations", type=int, default=100_000_000, help="iterations of the peak loop per thread")
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct", help="the model whose layer shapes are timed")
    ap.add_argument("--out", default="runs/int8-peak")
    args = ap.parse_args(argv)
    from transformers import AutoConfig

    from serving.engine.models import resolve_model_ref

    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    cfg = AutoConfig.from_pretrained(resolve_model_ref(args.model))
    shapes = layer_shapes(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size)
    token_macs = cfg.num_hidden_layers * sum(o * i for _, o, i in shapes) + cfg.vocab_size * cfg.hidden_size

    peak = loop_peak("#include <stdlib.h>\n" + LOOP, threads, args.iterations)
    print(f"peak: {peak}")
    # Where the compiler targets no AMX the program only returns 3. A tile product is about 256
    # vpdpbusd of work, hence fewer iterations.
    amx = loop_peak("#include <stdlib.h>\n#ifndef __AMX_INT8__\nint main(void) { return 3; }\n#else\n" + AMX_LOOP
                    + "#endif\n", threads, args.iterations // 50, optional=True)
    from serving.engine import cpu_kernels

    ext = cpu_kernels._rowdot_ext()
    int8_on_amx = bool(ext is not None and ext.rowdot_amx(-1))
    print(f"amx peak: {amx}; Choral's int8 kernel on AMX for more than one row: {int8_on_amx}")
    kernels = []
    # Where the int8 kernel runs on AMX, also time it with AMX turned off (its VNNI path, the same bits).
    for kind in ("q4", "int8", *(["int8-vnni"] if int8_on_amx else [])):
        layers = [(name, make_layer(kind.split("-")[0], o, i)) for name, o, i in shapes]
        if ext is not None:
            ext.rowdot_amx(int(kind != "int8-vnni"))
        for rows in [int(r) for r in args.rows.split(",")]:
            seconds = {name: time_call(mod, rows, max(3, 200 // rows)) for name, mod in layers}
            macs = rows * sum(mod.in_features * mod.out_features for _, mod in layers)
            rate = macs / sum(seconds.values()) / 1e9
            kernels.append({"kernel": kind, "rows": rows, "layer_ms": 1e3 * sum(seconds.values()), "gmac_per_s": rate,
                            "by_linear_gmac_per_s": {n: rows * m.in_features * m.out_features / seconds[n] / 1e9
                                                     for n, m in layers}})  # fmt: skip
            print(f"{kind} {rows:4d} rows: {rate:6.1f} GMAC/s")
    if ext is not None:
        ext.rowdot_amx(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result = {"threads": threads, "cpu": torch.backends.cpu.get_cpu_capability(), "peak": peak, "amx_peak": amx,
              "int8_on_amx": int8_on_amx, "token_gmac": token_macs / 1e9, "kernels": kernels}  # fmt: skip
    (out / "int8_peak.json").write_text(json.dumps(result, indent=2))
    lines = [f"Threads: {threads}. One token through the model: {token_macs / 1e9:.2f} G multiply-adds "
             "(every Linear and the head).", ""]  # fmt: skip
    if peak:
        lines += [f"Machine peak ({peak['isa']}, {peak['threads']} threads): **{peak['gmac_per_s']:.0f} GMAC/s** "
                  f"(best of {', '.join(f'{r:.0f}' for r in peak['runs'])}).", ""]  # fmt: skip
    if amx:
        lines += [f"AMX peak ({amx['isa']}, {amx['threads']} threads): **{amx['gmac_per_s']:.0f} GMAC/s** "
                  f"(best of {', '.join(f'{r:.0f}' for r in amx['runs'])}). Choral's int8 kernel runs calls of more "
                  f"than one row on AMX: {'yes' if int8_on_amx else 'no'}; its q4 kernel stays on the vector units.",
                  "", "The share of peak below is of the vector units' peak.", ""]  # fmt: skip
    lines += ["| kernel | rows | GMAC/s | of peak | arithmetic of a step of that many tokens, ms |", "|---|---|---|---|---|"]
    for k in kernels:
        share = f"{k['gmac_per_s'] / peak['gmac_per_s']:.0%}" if peak else "-"
        lines.append(f"| {k['kernel']} | {k['rows']} | {k['gmac_per_s']:.0f} | {share} | "
                     f"{k['rows'] * token_macs / 1e9 / k['gmac_per_s'] * 1e3:.1f} |")  # fmt: skip
    (out / "int8_peak.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
