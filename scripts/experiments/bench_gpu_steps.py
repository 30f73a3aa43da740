"""Per-step costs of the target and the draft on a GPU, through the engine's own ``ModelRunner``
(static KV cache, one forward per input width), eager and compiled with inductor (the engine's
``compile_backend`` on CUDA), each also replayed as CUDA graphs (``+graphs``, the engine's
``cuda_graphs``), and the speedup they predict at a given acceptance rate.

    python scripts/experiments/bench_gpu_steps.py                       # the bundled pair, bf16, on cuda
    python scripts/experiments/bench_gpu_steps.py --target .gpu/target --draft .gpu/draft --random-init

``--random-init`` builds each model from its ``config.json`` with random weights: the per-step
cost of a model does not depend on its weights, so a GPU machine that cannot hold the bundled
weights still measures real shapes. Acceptance does depend on the weights, so the predicted
speedups use per-token acceptance rates measured elsewhere (``--alphas``) in the router's cost model
(``routing.cost_model.speedup_model``, Leviathan et al.'s formula): a call drafts K tokens and verifies
K+1, and yields (1 - a^(K+1)) / (1 - a) tokens on average.

Prints a markdown table and writes JSON (default runs/gpu_steps.json).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from routing.cost_model import speedup_model  # noqa: E402
from serving.engine.devices import resolve_device, resolve_dtype, synchronize  # noqa: E402
from serving.engine.models import load_model, resolve_model_ref  # noqa: E402
from serving.engine.runner import ModelRunner  # noqa: E402


def build(ref: str, random_init: bool, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    if not random_init:
        return load_model(ref, dtype=dtype, device=device)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_model_ref(ref))
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)


def time_widths(runner: ModelRunner, widths: list[int], prefill: int, reps: int) -> dict[int, float]:
    """Median seconds of one forward of each width on top of a ``prefill``-token cache."""
    dev = runner.device
    high = min(1000, runner.model.config.vocab_size)  # token ids change no cost; a tiny test model has few
    runner.prefill(torch.randint(high // 10, high, (1, prefill), device=dev), 0)
    out = {}
    for w in widths:
        tokens = torch.randint(high // 10, high, (runner.batch_size, w), device=dev)  # [B, w]
        positions = (prefill + torch.arange(w, device=dev)).expand(runner.batch_size, w)  # [B, w]
        for _ in range(3):  # warm-up (and compile, for the compiled runner)
            runner.forward(tokens, positions)
        times = []
        for _ in range(reps):
            synchronize(dev)
            t = time.perf_counter()
            runner.forward(tokens, positions)
            synchronize(dev)
            times.append(time.perf_counter() - t)
        out[w] = statistics.median(times)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    p.add_argument("--random-init", action="store_true", help="random weights from each model's config.json")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prefill", type=int, default=128)
    p.add_argument("--ks", default="2,4,8", help="draft lengths K to predict for")
    p.add_argument("--alphas", default="0.6,0.75,0.9", help="acceptance rates to predict for")
    p.add_argument("--modes", default="eager,inductor,eager+graphs,inductor+graphs",
                   help="eager or a torch.compile backend, each optionally +graphs (CUDA graphs)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--json", default="runs/gpu_steps.json")
    args = p.parse_args(argv)
    device, dtype = resolve_device(args.device), resolve_dtype(args.dtype)
    ks = [int(k) for k in args.ks.split(",")]
    alphas = [float(a) for a in args.alphas.split(",")]
    widths = sorted({1} | {k + 1 for k in ks})
    models = {"target": build(args.target, args.random_init, device, dtype),
              "draft": build(args.draft, args.random_init, device, dtype)}  # fmt: skip
    rows, predictions = [], []
    for mode in args.modes.split(","):
        cost = {}
        for role, model in models.items():
            runner = ModelRunner(model, batch_size=args.batch, max_len=args.prefill + max(widths) + 8)
            backend, _, graphs = mode.partition("+")
            if backend != "eager":
                torch._dynamo.reset()
                runner.compile(backend)
            if graphs:  # "+graphs": every width replays as a CUDA graph (EngineConfig.cuda_graphs)
                runner.use_cuda_graphs()
            cost[role] = time_widths(runner, widths if role == "target" else [1], args.prefill, args.reps)
            del runner
        t1 = cost["target"][1]
        for w in widths:
            rows.append({"mode": mode, "model": "target", "tokens": w, "ms": 1e3 * cost["target"][w], "x_one_token": cost["target"][w] / t1})
        rows.append({"mode": mode, "model": "draft", "tokens": 1, "ms": 1e3 * cost["draft"][1], "x_one_token": cost["draft"][1] / t1})
        for k in ks:
            for a in alphas:
                speedup = speedup_model(torch.tensor(a), torch.tensor(k), cost["draft"][1] / t1, cost["target"][k + 1] / t1)
                predictions.append({"mode": mode, "k": k, "alpha": a, "speedup": float(speedup)})
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    print(f"\n{gpu}, {args.dtype}, batch {args.batch}, after a {args.prefill}-token prefill"
          f"{' (random weights, real shapes)' if args.random_init else ''}\n")  # fmt: skip
    print("| mode | model | tokens in the step | ms | x a 1-token target step |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['mode']} | {r['model']} | {r['tokens']} | {r['ms']:.2f} | {r['x_one_token']:.2f} |")
    print("\nPredicted speedup over the target alone (draft K, verify K+1):\n")
    print("| mode | K | " + " | ".join(f"a={a}" for a in alphas) + " |\n|---|---|" + "---|" * len(alphas))
    for mode in args.modes.split(","):
        for k in ks:
            vals = [x["speedup"] for x in predictions if x["mode"] == mode and x["k"] == k]
            print(f"| {mode} | {k} | " + " | ".join(f"{v:.2f}x" for v in vals) + " |")
    out = {"device": gpu, "torch": torch.__version__, "dtype": args.dtype, "batch": args.batch, "prefill": args.prefill,
           "random_init": args.random_init, "target": args.target, "draft": args.draft, "steps": rows, "predicted": predictions}  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
