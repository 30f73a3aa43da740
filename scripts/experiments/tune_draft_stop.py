"""Compare drafting-stop rules with Choral alone, on prompts that spec-bench does not use.

    python scripts/experiments/tune_draft_stop.py --prompts-per-domain 4 --out runs/tune-draft-stop

The comparison lives in serving/tools/stop_tuning.py (the tests drive it from there); its docstring
says what is compared and reported.
"""

from __future__ import annotations

from serving.tools.stop_tuning import main

if __name__ == "__main__":
    raise SystemExit(main())
