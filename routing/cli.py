"""collect-router-data and train-router.

    collect-router-data --config configs/router_collect.yaml [--shard i/n] [key=value ...]
    collect-router-data --merge OUT.jsonl SHARD.jsonl [SHARD.jsonl ...]
    accelerate launch --num_processes 2 -m routing.cli collect --config configs/router_collect.yaml
    train-router --config configs/router_train.yaml [key=value ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from routing.config import CollectConfig, RouterTrainConfig
from serving.cli import Command
from serving.config import ConfigError

COLLECT = Command(
    "collect-router-data", CollectConfig,
    "Measure every prompt x draft with the real engine; append rows to a JSONL file (resumable).\n\n" + __doc__,
)  # fmt: skip
COLLECT.parser.add_argument("--shard", help="i/n: take prompts i, i+n, ... (0 <= i < n) into <output>.shard<i>of<n>.jsonl")
COLLECT.parser.add_argument("--merge", nargs="+", metavar=("OUT", "SHARD"), help="join shard files into OUT and exit")
COLLECT.parser.add_argument("--profile", metavar="PATH", help="also write a simulator profile (YAML/JSON) of the rows (serving/fleet/profile.py)")

TRAIN = Command("train-router", RouterTrainConfig, "Train and evaluate the draft router on collected rows.\n\n" + __doc__,
                errors=(ValueError, FileNotFoundError))  # fmt: skip


def collect_main(argv: list[str] | None = None) -> int:
    return COLLECT.main(argv, _collect, early=_merge)


def _merge(args: argparse.Namespace) -> int | None:
    """``--merge OUT SHARD...``: join shard files (no settings needed)."""
    if not args.merge:
        return None
    from routing.rows import merge

    if len(args.merge) < 2:
        COLLECT.parser.error("--merge needs OUT and at least one shard file")
    try:
        n = merge(args.merge[0], args.merge[1:])
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    print(f"collect-router-data: merged {len(args.merge) - 1} files into {args.merge[0]} ({n} rows)")
    return _write_profile(args.merge[0], args.profile)


def _collect(cfg: CollectConfig, args: argparse.Namespace) -> int:
    from routing.collect import collect, load_sources, parse_shard

    try:
        shard = parse_shard(args.shard) if args.shard else None
        load_sources(cfg)  # a bad source fails before any model loads
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(str(e)) from None
    path = collect(cfg, shard=shard)
    print(f"collect-router-data: rows in {path}")
    return _write_profile(path, args.profile)


def _write_profile(rows: str | Path, out: str | None) -> int:
    """The simulator's profile of collected rows (costs, acceptance per draft and domain, lengths)."""
    if not out:
        return 0
    from serving.fleet.profile import from_router_data

    try:
        from_router_data(rows).save(out)
    except ValueError as e:
        return COLLECT.fail(f"cannot make a profile of {rows}: {e}")
    print(f"collect-router-data: simulator profile in {out}")
    return 0


def train_main(argv: list[str] | None = None) -> int:
    return TRAIN.main(argv, _train)


def _train(cfg: RouterTrainConfig, args: argparse.Namespace) -> int:
    from routing.train import train  # heavy imports only once the config is valid

    train(cfg)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m routing.cli collect|train ...`` (for accelerate launch)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("collect", "train"):
        print("usage: python -m routing.cli collect|train [options]", file=sys.stderr)
        return 2
    return (collect_main if argv[0] == "collect" else train_main)(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
