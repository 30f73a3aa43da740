"""Compare train-draft runs of the same student: untrained vs each run's final and best step.

    python scripts/experiments/compare_drafts.py runs/draft-code-distill runs/draft-code-finetune --out runs/drafts-compare
    python scripts/experiments/compare_drafts.py runs/draft-code-distill runs/draft-code-finetune --measure 40 --draft-weights fp32

The comparison lives in training/compare_runs.py (the tests drive it from there); its docstring
says what is read, what ``--measure`` re-measures, and what is written.
"""

from __future__ import annotations

from training.compare_runs import main

if __name__ == "__main__":
    raise SystemExit(main())
