"""Write the ``vllm serve`` command that serves a Choral-trained draft with vLLM's own speculative
decoding (``--speculative-config``, method ``draft_model``), e.g. on Trainium with the vLLM Neuron
plugin, which AWS points inference users to.

    python scripts/export_vllm.py --target qwen2.5-coder-1.5b-instruct \
        --draft runs/draft-code-distill/best --k 4 --out runs/vllm

Bundled names are resolved to their converted Hugging Face folders, so the command works offline
on the machine that holds them (copy the folders along otherwise). A Choral draft is a plain
Hugging Face checkpoint; vLLM ignores its ``draft_vocab`` (Choral's reduced head) and drafts over
the full vocabulary, which is still lossless, only a little slower. Writes ``vllm_serve.sh`` and
``speculative_config.json``; runs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from pathlib import Path

from serving.engine.models import check_same_tokenizer, load_tokenizer, resolve_model_ref


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", required=True, help="hub id, folder or bundled name")
    ap.add_argument("--draft", required=True, help="hub id, folder or bundled name (e.g. <train-draft output.dir>/best)")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--out", default="runs/vllm")
    args = ap.parse_args(argv)
    if args.k < 1:
        raise SystemExit(f"--k {args.k}: speculative decoding needs at least one draft token")

    target, draft = resolve_model_ref(args.target), resolve_model_ref(args.draft)
    # vLLM requires the draft to share the target's vocabulary; check it here, where the error is clear.
    check_same_tokenizer(load_tokenizer(target), load_tokenizer(draft), draft_name=f"draft {args.draft!r}")
    spec = {"model": str(Path(draft).resolve()) if os.path.isdir(draft) else draft,
            "num_speculative_tokens": args.k, "method": "draft_model"}  # fmt: skip
    target_arg = str(Path(target).resolve()) if os.path.isdir(target) else target
    cmd = ["vllm", "serve", target_arg, "--port", str(args.port), "--max-model-len", str(args.max_model_len),
           "--speculative-config", json.dumps(spec)]  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative_config.json").write_text(json.dumps(spec, indent=2) + "\n")
    script = out / "vllm_serve.sh"
    script.write_text(
        "#!/bin/sh\n# Written by scripts/export_vllm.py. On Trainium install vLLM with its Neuron plugin first;\n"
        "# the plugin picks the neuron device itself.\n" + shlex.join(cmd) + "\n"
    )
    script.chmod(0o755)
    print(shlex.join(cmd))
    print(f"-> {script}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
