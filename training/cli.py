"""train-draft: fine-tune or distill a domain draft from the target.

    train-draft --config configs/distill_code.yaml [--resume] [key=value ...]
    accelerate launch --num_processes 2 -m training.cli --config configs/distill_code.yaml train.device=cpu
"""

from __future__ import annotations

import argparse
import sys

from serving.config import ConfigError, describe, load_config
from training.config import TrainDraftConfig


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="train-draft", description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="YAML file (configs/train_code.yaml, configs/distill_*.yaml)")
    ap.add_argument("--resume", action="store_true", help="continue from <output.dir>/last if it exists")
    ap.add_argument("--show-config", action="store_true", help="list every key with its type, default and doc")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.max_steps=50")
    args = ap.parse_args(argv)
    if args.show_config:
        print(describe(TrainDraftConfig))
        return 0
    try:
        cfg = load_config(TrainDraftConfig, args.config, args.overrides)
    except ConfigError as e:
        print(f"train-draft: error: {e}", file=sys.stderr)
        return 2
    from training.train import train  # heavy imports only once the config is valid

    train(cfg, resume=args.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
