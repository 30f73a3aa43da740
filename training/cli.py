"""train-draft: fine-tune or distill a domain draft from the target.

    train-draft --config configs/distill_code.yaml [--resume] [key=value ...]
    train-draft --describe                     # every key (alias: --show-config)
    accelerate launch --num_processes 2 -m training.cli --config configs/distill_code.yaml train.device=cpu
"""

from __future__ import annotations

import argparse
import sys

from serving.cli import Command
from training.checkpoint import CheckpointError
from training.config import TrainDraftConfig

CLI = Command("train-draft", TrainDraftConfig, __doc__, errors=(CheckpointError,))
CLI.parser.add_argument("--resume", action="store_true", help="continue from <output.dir>/last if it exists")


def main(argv: list[str] | None = None) -> int:
    return CLI.main(argv, run)


def run(cfg: TrainDraftConfig, args: argparse.Namespace) -> int:
    from serving.engine.devices import steady_host_allocator
    from training.train import train  # heavy imports only once the config is valid

    steady_host_allocator()  # training steps and engine evaluations alternate: keep the heap from fragmenting
    train(cfg, resume=args.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
