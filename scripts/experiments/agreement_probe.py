"""Teacher-forced greedy agreement of code drafts with the target: a fast proxy for acceptance.

    python scripts/experiments/agreement_probe.py qwen2.5-coder-0.5b-instruct runs/draft-code-head/final \
        --draft-vocab-from runs/draft-code-head/final --out runs/agreement-probe

The probe lives in training/agreement.py (the tests drive it from there); its docstring says
which prompts it uses and what it scores.
"""

from __future__ import annotations

from training.agreement import main

if __name__ == "__main__":
    raise SystemExit(main())
