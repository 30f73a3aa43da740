"""Load test for `serve`: N concurrent streaming clients against a local server.

    python scripts/load_test.py --url http://127.0.0.1:8000 --concurrency 8 --requests 64 \\
        --max-tokens 64 --compare-sequential --out runs/load

What it sends and reports is described in serving/tools/load_test.py, where the load test lives (the
tests drive it from there); ``python scripts/load_test.py --help`` lists the options.
"""

from __future__ import annotations

import sys

from serving.tools.load_test import main

if __name__ == "__main__":
    sys.exit(main())
