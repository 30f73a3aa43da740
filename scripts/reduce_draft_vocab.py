"""Give an existing draft a reduced output vocabulary (FR-Spec, Zhao et al. 2025) without training.

    python scripts/reduce_draft_vocab.py --draft qwen2.5-coder-0.5b-instruct --keep 32768 \
        --out runs/drafts/qwen2.5-coder-0.5b-v32k

Counts token frequencies on the training text of the chosen domains (the same sources and the
same evaluation guard as ``train-draft``: never HumanEval or the evaluation rows), keeps the
``--keep`` most frequent ids plus EOS, and writes a copy of the draft whose config carries them
as ``draft_vocab``. Weights are unchanged; Choral's engine then computes only those rows of the
draft's output head, the target still verifies over the full vocabulary (lossless). The folder is
an ordinary Hugging Face model folder, usable wherever a draft reference is.
"""

from __future__ import annotations

import argparse
import json

import torch

from serving.engine.models import eos_token_ids, load_model, load_tokenizer
from training.checkpoint import atomic_dir
from training.data import load_domain_texts, tokenize_and_pack
from training.students import frequent_tokens, reduce_vocab


def parse_docs(text: str, domains: list[str]) -> dict[str, int]:
    """``"300"`` -> 300 for every domain; ``"code=300,chat=20000"`` -> per domain (others 300).

    Code files are long and chat/math prompts short, so counting on equal numbers of documents
    would leave the chat and math tokens a rounding error next to code's."""
    if "=" not in text:
        return {d: int(text) for d in domains}
    docs = {d: 300 for d in domains}
    for part in text.split(","):
        name, _, n = part.partition("=")
        if name.strip() not in docs:
            raise SystemExit(f"--docs names {name.strip()!r}, which is not in --domains {domains}")
        docs[name.strip()] = int(n)
    return docs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draft", required=True, help="draft: hub id, folder or bundled name")
    ap.add_argument("--keep", type=int, default=32768, help="token ids to keep in the draft's head")
    ap.add_argument("--domains", nargs="+", default=["code", "chat", "math"])
    ap.add_argument("--docs", default="code=300,chat=20000,math=20000",
                    help="training documents to count on: one number for every domain, or domain=N,...")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    tokenizer = load_tokenizer(args.draft)
    model = load_model(args.draft)
    docs = parse_docs(args.docs, args.domains)
    rows = []
    for domain in args.domains:
        texts = load_domain_texts(domain, docs[domain], tokenizer=tokenizer)
        rows.append(tokenize_and_pack(texts, tokenizer, 1, tokenizer.eos_token_id).flatten())
        print(f"{domain}: {rows[-1].numel()} tokens")
    counted = torch.cat(rows)
    kept = frequent_tokens(counted, args.keep, always=eos_token_ids(model, tokenizer))
    reduce_vocab(model, kept)
    coverage = torch.isin(counted, torch.tensor(kept)).float().mean().item()
    with atomic_dir(args.out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / "draft_vocab.json").write_text(json.dumps(
            {"source": args.draft, "keep": len(kept), "domains": args.domains, "docs_per_domain": docs,
             "counted_tokens": counted.numel(), "coverage_of_counted_tokens": coverage}, indent=2))  # fmt: skip
    print(f"kept {len(kept)} ids, covering {coverage:.4f} of {counted.numel()} counted tokens -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
