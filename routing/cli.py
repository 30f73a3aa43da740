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

from serving.config import ConfigError, describe, load_config


def collect_main(argv: list[str] | None = None) -> int:
    from routing.config import CollectConfig

    ap = argparse.ArgumentParser(
        prog="collect-router-data",
        description="Measure every prompt x draft with the real engine; append rows to a JSONL file (resumable).",
    )
    ap.add_argument("--config", help="YAML file (configs/router_collect.yaml)")
    ap.add_argument("--shard", help="i/n: take prompts i, i+n, ... (0 <= i < n) into <output>.shard<i>of<n>.jsonl")
    ap.add_argument("--merge", nargs="+", metavar=("OUT", "SHARD"), help="join shard files into OUT and exit")
    ap.add_argument("--profile", metavar="PATH", help="also write a simulator profile (YAML/JSON) of the rows (serving/profile.py)")
    ap.add_argument("--show-config", action="store_true", help="list every key with its type, default and doc")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. decode.max_new_tokens=32")
    args = ap.parse_args(argv)
    if args.show_config:
        print(describe(CollectConfig))
        return 0
    from routing.rows import merge

    if args.merge:
        if len(args.merge) < 2:
            ap.error("--merge needs OUT and at least one shard file")
        try:
            n = merge(args.merge[0], args.merge[1:])
        except (FileNotFoundError, ValueError) as e:
            print(f"collect-router-data: error: {e}", file=sys.stderr)
            return 2
        print(f"collect-router-data: merged {len(args.merge) - 1} files into {args.merge[0]} ({n} rows)")
        return _write_profile(args.merge[0], args.profile)
    try:
        cfg = load_config(CollectConfig, args.config, args.overrides)
        from routing.collect import collect, load_sources, parse_shard

        shard = parse_shard(args.shard) if args.shard else None
        load_sources(cfg)  # a bad source fails before any model loads
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"collect-router-data: error: {e}", file=sys.stderr)
        return 2
    path = collect(cfg, shard=shard)
    print(f"collect-router-data: rows in {path}")
    return _write_profile(path, args.profile)


def _write_profile(rows: str | Path, out: str | None) -> int:
    """The simulator's profile of collected rows (costs, acceptance per draft and domain, lengths)."""
    if not out:
        return 0
    from serving.profile import from_router_data

    try:
        from_router_data(rows).save(out)
    except ValueError as e:
        print(f"collect-router-data: error: cannot make a profile of {rows}: {e}", file=sys.stderr)
        return 2
    print(f"collect-router-data: simulator profile in {out}")
    return 0


def train_main(argv: list[str] | None = None) -> int:
    from routing.config import RouterTrainConfig

    ap = argparse.ArgumentParser(prog="train-router", description="Train and evaluate the draft router on collected rows.")
    ap.add_argument("--config", help="YAML file (configs/router_train.yaml)")
    ap.add_argument("--show-config", action="store_true", help="list every key with its type, default and doc")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. objective=speedup")
    args = ap.parse_args(argv)
    if args.show_config:
        print(describe(RouterTrainConfig))
        return 0
    try:
        cfg = load_config(RouterTrainConfig, args.config, args.overrides)
    except ConfigError as e:
        print(f"train-router: error: {e}", file=sys.stderr)
        return 2
    from routing.train import train  # heavy imports only once the config is valid

    try:
        train(cfg)
    except (FileNotFoundError, ValueError) as e:
        print(f"train-router: error: {e}", file=sys.stderr)
        return 2
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
