"""spec-generate: speculative (or target-only) generation from the command line.

    spec-generate --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --prompt "def quicksort(xs):" --max-new-tokens 64 --json
    spec-generate --prompt-file prompts.jsonl --chat engine.max_batch_size=4 sampling.temperature=0.7
    spec-generate --describe                   # every setting; each flag is a shorthand for one

Flags map onto the settings (``--k`` is ``engine.k``, ``--temperature`` is
``sampling.temperature``); ``--config FILE`` and ``key=value`` overrides work as on every command.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from typing import Literal

from serving.cli import Command, Flag
from serving.engine.engine_settings import EngineSettings
from serving.engine.sampling import SamplingParams


def doc(text: str) -> dict:
    return {"doc": text}


@dataclass
class GenerateConfig:
    target: str = field(default="qwen2.5-coder-1.5b-instruct", metadata=doc("target: hub id, folder or bundled name"))
    draft: str | None = field(default=None, metadata=doc(
        "drafter: a draft model reference, ngram or suffix (model-free); null or none decodes with the target alone"))
    prompt: str | None = field(default=None, metadata=doc("the prompt text (or prompt_file)"))
    prompt_file: str | None = field(default=None, metadata=doc(".txt (one prompt per line) or .jsonl with a 'text' field"))
    chat: bool = field(default=False, metadata=doc("wrap each prompt in the tokenizer's chat template"))
    max_new_tokens: int = field(default=128, metadata=doc("tokens to generate per prompt"))
    stop: list[str] = field(default_factory=list, metadata=doc("stop strings"))
    output: Literal["text", "json"] = field(default="text", metadata=doc(
        "text: each answer, statistics on stderr; json: one JSON object per prompt"))
    sampling: SamplingParams = field(default_factory=SamplingParams)  # temperature 0: greedy
    engine: EngineSettings = field(default_factory=EngineSettings)  # engine.max_batch_size: prompts decoded together

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_file is None):
            raise ValueError("give one prompt source: --prompt TEXT or --prompt-file FILE")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be >= 1")


CLI = Command("spec-generate", GenerateConfig, __doc__, flags=[
    Flag("--target", "target"),
    Flag("--draft", "draft"),
    Flag("--prompt", "prompt"),
    Flag("--prompt-file", "prompt_file"),
    Flag("--chat", "chat", const=True),
    Flag("--max-new-tokens", "max_new_tokens"),
    Flag("--temperature", "sampling.temperature", help="0 = greedy"),
    Flag("--top-k", "sampling.top_k", help="keep the k most likely tokens; 0 disables"),
    Flag("--top-p", "sampling.top_p", help="nucleus; 1 disables"),
    Flag("--seed", "sampling.seed", help="seeds each request's own generator"),
    Flag("--stop", "stop", repeat=True, help="stop string (repeatable)"),
    Flag("--json", "output", const="json", help="print one JSON object per prompt"),
    Flag("--k", "engine.k"),
    Flag("--draft-confidence", "engine.draft_confidence"),
    Flag("--draft-stop", "engine.draft_stop"),
    Flag("--device", "engine.device"),
    Flag("--dtype", "engine.dtype"),
    Flag("--quantize", "engine.quantize"),
    Flag("--draft-weights", "engine.draft_weights"),
    Flag("--target-weights", "engine.target_weights"),
    Flag("--no-cpu-kernels", "engine.cpu_kernels", const=False,
         help="use stock PyTorch kernels on the CPU instead of Choral's batch-invariant ones"),
    Flag(("--batch-size", "--max-batch-size"), "engine.max_batch_size", help="prompts decoded together"),
    Flag("--max-len", "engine.max_len"),
    Flag("--compile", "engine.compile_backend", const="auto", help="compile the step shapes (slow start, faster steps)"),
], errors=(ValueError, FileNotFoundError, RuntimeError))  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    return CLI.main(argv, run)


def run(cfg: GenerateConfig, args: argparse.Namespace) -> int:
    from serving.engine import Request
    from serving.engine.loader import load_engine
    from serving.prompts import read_prompt_file

    texts = [cfg.prompt] if cfg.prompt is not None else [p.text for p in read_prompt_file(cfg.prompt_file)]
    # The draft: a model reference, a built-in model-free drafter (ngram, suffix) or none.
    engine = load_engine(cfg.engine, cfg.target, {"draft": cfg.draft} if cfg.draft not in (None, "none") else {}).engine
    tok = engine.tokenizer
    if cfg.chat:
        texts = [tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True) for t in texts]
    requests = [Request(tok.encode(t, add_special_tokens=False), cfg.sampling, cfg.max_new_tokens, tuple(cfg.stop)) for t in texts]
    outputs = engine.generate(requests)
    for out in outputs:
        if cfg.output == "json":
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
