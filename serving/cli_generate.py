"""spec-generate: speculative (or target-only) generation from the command line.

    spec-generate --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --prompt "def quicksort(xs):" --max-new-tokens 64 --json
"""

from __future__ import annotations

import argparse
import json
import sys

from serving.engine import DRAFT_STOPS, EngineConfig, Request, SpeculativeEngine
from serving.prompts import read_prompt_file
from serving.sampling import SamplingParams


def parse_k(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--k {value!r}: give an integer or 'auto'") from None


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="spec-generate", description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="hub id, folder or bundled name")
    ap.add_argument("--draft", default=None, help="draft model reference; omit to decode with the target alone")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text")
    src.add_argument("--prompt-file", help=".txt (one prompt per line) or .jsonl with a 'text' field")
    ap.add_argument("--chat", action="store_true", help="wrap each prompt in the tokenizer's chat template")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    ap.add_argument("--k", type=parse_k, default=4, help="draft tokens per step, or 'auto'")
    ap.add_argument("--draft-confidence", type=float, default=None,
                    help="stop drafting once the draft's top probability drops below this (CPU)")
    ap.add_argument("--draft-stop", choices=DRAFT_STOPS, default="token",
                    help="with --draft-confidence: each token's top probability, or their running product")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "neuron"])
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--quantize", choices=["int8-dynamic"], default=None,
                    help="CPU dynamic int8 (fast, but greedy output may differ from fp32: see README)")
    ap.add_argument("--draft-weights", choices=["auto", "fp32", "int8"], default="auto",
                    help="int8: the draft runs as W8A8 int8 on the CPU kernels (output unchanged); auto: int8 wherever they run")
    ap.add_argument("--no-cpu-kernels", action="store_true",
                    help="use stock PyTorch kernels on the CPU instead of Choral's batch-invariant ones")
    ap.add_argument("--batch-size", type=int, default=1, help="prompts decoded together")
    ap.add_argument("--max-len", type=int, default=None, help="context per sequence (default: min(2048, model's))")
    ap.add_argument("--compile", action="store_true", help="compile the step shapes (slow start, faster steps)")
    ap.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
        texts = [args.prompt] if args.prompt is not None else [p.text for p in read_prompt_file(args.prompt_file)]
        config = EngineConfig(
            max_batch_size=args.batch_size,
            max_len=args.max_len,
            k=args.k if args.draft else 0,
            draft_confidence=args.draft_confidence,
            draft_stop=args.draft_stop,
        )
        engine = SpeculativeEngine.load(
            args.target, args.draft, device=args.device, dtype=args.dtype, quantize=args.quantize,
            # The CPU kernels are eager-only (an extension call, host-side attention lengths).
            cpu_kernels=not (args.no_cpu_kernels or args.compile), draft_weights=args.draft_weights, config=config
        )
        if args.compile:
            engine.enable_compile()
        tok = engine.tokenizer
        if args.chat:
            texts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True) for t in texts]
        requests = [
            Request(tok.encode(t, add_special_tokens=False), params, args.max_new_tokens, tuple(args.stop)) for t in texts
        ]
        outputs = engine.generate(requests)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"spec-generate: error: {e}", file=sys.stderr)
        return 2
    for out in outputs:
        if args.json:
            print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason, "stats": out.stats}))
        else:
            print(out.text)
            s = out.stats
            print(
                f"[{s['new_tokens']} tokens, {s['tokens_per_second']:.2f} tok/s, acceptance {s['acceptance_rate']:.2f}, "
                f"{s['mean_accepted_length']:.2f} tokens/target call]",
                file=sys.stderr,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
