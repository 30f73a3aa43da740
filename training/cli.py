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
CLI.parser.add_argument("--profile", metavar="NAME", help="apply the config file's profiles.NAME settings (e.g. quick)")


def main(argv: list[str] | None = None) -> int:
    return CLI.main(argv, run)


def with_profile(cfg: TrainDraftConfig, args: argparse.Namespace) -> TrainDraftConfig:
    """``cfg`` with ``profiles[--profile]`` applied over the file (command-line overrides still last)."""
    if not args.profile:
        return cfg
    from serving.config import ConfigError, load_config

    if args.profile not in cfg.profiles:
        raise ConfigError(f"--profile {args.profile}: the config defines no such profile; it has "
                          f"{sorted(cfg.profiles) or 'none'} (add profiles.{args.profile} to {args.config})")  # fmt: skip
    return load_config(TrainDraftConfig, args.config, args.overrides, dict(cfg.profiles[args.profile]))


def run(cfg: TrainDraftConfig, args: argparse.Namespace) -> int:
    from serving.engine.devices import steady_host_allocator
    from training.recipes import train  # heavy imports only once the config is valid

    steady_host_allocator()  # training steps and engine evaluations alternate: keep the heap from fragmenting
    train(with_profile(cfg, args), resume=args.resume)
    return 0


if __name__ == "__main__":
    sys.exit(main())
