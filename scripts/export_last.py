"""Write a train-draft run's resumable ``last/`` state as a Hugging Face model folder.

    python scripts/export_last.py runs/draft-code-distill --out runs/draft-code-distill/final

For runs made before ``train-draft`` wrote ``final/`` itself: the architecture, config (reduced
draft vocabulary included) and tokenizer come from the run's ``best/``, the weights from
``last/state/model.safetensors``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from training.checkpoint import atomic_dir


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run", help="train-draft output folder with best/ and last/")
    ap.add_argument("--out", help="default: RUN/final")
    args = ap.parse_args(argv)
    run = Path(args.run)
    model = AutoModelForCausalLM.from_pretrained(run / "best")
    state = load_file(run / "last" / "state" / "model.safetensors")
    missing, unexpected = model.load_state_dict(state, strict=False)
    # A tied head is saved once; anything else missing means the layouts differ.
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    if unexpected or set(missing) - tied:
        raise SystemExit(f"last/ does not match best/: missing {missing[:5]}, unexpected {unexpected[:5]}")
    out = Path(args.out or run / "final")
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(run / "best").save_pretrained(tmp)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
