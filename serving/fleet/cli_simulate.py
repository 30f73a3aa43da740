"""simulate: plan a speculative-decoding deployment with a discrete-event model fed by a profile.

    simulate --config configs/simulate.yaml                       # one run: the 10k-client scale case
    simulate --config configs/simulate.yaml architecture=fused k.kind=adaptive
    simulate --config configs/simulate.yaml sweep.param=clients sweep.values=[2000,4000,8000]
    simulate --describe                                           # every config key

One run writes ``simulate.json`` (summary, per device class, per target, time series),
``simulate.md`` and ``simulate.png`` (queue depth, utilisation, throughput over time, latency
CDFs) under ``output.dir``. With ``sweep.param`` set it runs once per value of the param and per
value of ``sweep.compare`` (default: round robin vs JSQ(2) balancing) and writes ``sweep.json``,
``sweep.md`` and ``sweep.png``. ``sweep.param=clients`` with numbers sets the total client count,
keeping the device-class mix.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from serving.cli import Command
from serving.config import ConfigError, load_config
from serving.fleet.profile import Profile, load_profile
from serving.fleet.simulator import SimulateConfig, simulate


def load_scenario_profile(cfg: SimulateConfig) -> Profile:
    if cfg.profile is None or not Path(cfg.profile).exists():
        raise ConfigError(
            f"profile={cfg.profile!r} does not exist: write one with `spec-bench --profile PATH` "
            "(or serving.fleet.profile.from_router_data / from_load_test), or use the measured "
            "configs/profiles/cpu_bundled.yaml"
        )
    return load_profile(cfg.profile)


def sweep_overrides(base: SimulateConfig, param: str, value: Any) -> list[str]:
    """Overrides that set ``param`` to ``value``; ``clients`` with a number scales the class mix."""
    if param == "clients" and isinstance(value, (int, float)) and not isinstance(value, bool):
        total = sum(base.clients.values())
        counts = {c: round(n * value / total) for c, n in base.clients.items()}
        return [f"clients={json.dumps(counts)}"]
    return [f"{param}={json.dumps(value)}"]


def run_sweep(path: str | None, overrides: list[str], base: SimulateConfig, progress: bool) -> list[dict]:
    sw = base.sweep
    if not sw.values:
        raise ConfigError(f"sweep.param={sw.param!r} is set but sweep.values is empty: give the values to try, e.g. sweep.values=[1,2,4]")
    compares = sw.compare_values if sw.compare else [None]
    runs = []
    from tqdm import tqdm

    with tqdm(total=len(sw.values) * len(compares), desc="sweep", unit="run", disable=not progress) as bar:
        for value in sw.values:
            for other in compares:
                extra = sweep_overrides(base, sw.param, value)
                if sw.compare:
                    extra += sweep_overrides(base, sw.compare, other)
                cfg = load_config(SimulateConfig, path, [*overrides, *extra])
                result = simulate(cfg, load_scenario_profile(cfg))
                runs.append({"value": value, "compare": other, "summary": result["summary"]})
                s = result["summary"]
                bar.update(1)
                bar.set_postfix_str(f"{sw.param}={value} {sw.compare}={other} TTFT p99 {s['ttft_ms']['p99']:.0f} ms")
    return runs


def markdown(result: dict) -> str:
    cfg, s = result["config"], result["summary"]
    n_targets = sum(g["count"] for g in cfg["targets"])
    lines = [
        f"# simulate: {sum(cfg['clients'].values())} clients ({', '.join(f'{n} {c}' for c, n in cfg['clients'].items())}), "
        f"{n_targets} targets, {cfg['architecture']}",
        "",
        f"{cfg['duration_s']:.0f} simulated s ({cfg['warmup_s']:.0f} s warm-up), arrivals {cfg['arrivals']['kind']}, "
        f"balancer {cfg['balancer']}, K {cfg['k']['kind']} {cfg['k']['k']}, draft {cfg['draft']['policy']}, "
        f"SLO TTFT <= {cfg['slo']['ttft_ms']:.0f} ms and TPOT <= {cfg['slo']['tpot_ms']:.0f} ms, seed {cfg['seed']}. "
        f"Profile: {result['profile'].get('source')}. Wall time {s['wall_s']:.1f} s (CPU {s['cpu_s']:.1f} s).",
        "",
        "| metric | value |",
        "|---|---|",
        f"| requests completed / arrived | {s['requests_completed']} / {s['requests_arrived']} |",
        f"| throughput | {s['throughput_tokens_per_s']:.0f} tokens/s, {s['requests_per_s']:.2f} requests/s |",
        f"| goodput | {s['goodput_tokens_per_s']:.0f} tokens/s, {s['goodput_requests_per_s']:.2f} requests/s ({100 * s['goodput_fraction']:.1f}% of requests) |",
        f"| TTFT p50 / p90 / p99 | {_p(s['ttft_ms'])} ms |",
        f"| TPOT p50 / p90 / p99 | {_p(s['tpot_ms'])} ms |",
        f"| end to end p50 / p90 / p99 | {_p(s['e2e_ms'])} ms |",
        f"| wait for a busy client p50 / p99 | {_fmt(s['client_wait_ms']['p50'])} / {_fmt(s['client_wait_ms']['p99'])} ms |",
        f"| tokens per target call, acceptance | {s['tokens_per_target_call']:.2f}, {s['acceptance_rate']:.3f} |",
        f"| mean batch rows | {s['mean_batch_rows']:.2f} |",
        f"| target utilisation mean / max | {s['utilisation_mean']:.2f} / {s['utilisation_max']:.2f} |",
        f"| queue depth per target mean / max | {s['queue_depth_mean']:.2f} / {s['queue_depth_max']} |",
        "",
        "| device class | requests | TTFT p50 / p90 / p99 ms | TPOT p50 / p90 / p99 ms | within SLO |",
        "|---|---|---|---|---|",
    ]
    for c, m in result["per_class"].items():
        lines.append(f"| {c} | {m['requests']} | {_p(m['ttft_ms'])} | {_p(m['tpot_ms'])} | {100 * m['goodput_fraction']:.1f}% |")
    lines += ["", "Draft per domain: " + ", ".join(f"{d}: {n}" for d, n in result["per_domain_draft"].items())]
    return "\n".join(lines) + "\n"


def sweep_markdown(runs: list[dict], cfg: SimulateConfig) -> str:
    sw = cfg.sweep
    lines = [
        f"# simulate sweep: {sw.param}" + (f" x {sw.compare}" if sw.compare else ""),
        "",
        f"SLO TTFT <= {cfg.slo.ttft_ms:.0f} ms, TPOT <= {cfg.slo.tpot_ms:.0f} ms; {cfg.duration_s:.0f} simulated s each.",
        "",
        f"| {sw.param} | {sw.compare or '-'} | tokens/s | goodput tokens/s | within SLO | TTFT p50 / p99 ms | TPOT p50 / p99 ms | utilisation | wall s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        s = r["summary"]
        lines.append(
            f"| {r['value']} | {r['compare'] if r['compare'] is not None else '-'} | {s['throughput_tokens_per_s']:.0f} | "
            f"{s['goodput_tokens_per_s']:.0f} | {100 * s['goodput_fraction']:.1f}% | {_fmt(s['ttft_ms']['p50'])} / {_fmt(s['ttft_ms']['p99'])} | "
            f"{_fmt(s['tpot_ms']['p50'])} / {_fmt(s['tpot_ms']['p99'])} | {s['utilisation_mean']:.2f} | {s['wall_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ts = result["timeseries"]
    n_targets = len(result["per_target"]["utilisation"])
    fig, ax = plt.subplots(2, 2, figsize=(11, 7))
    ax[0, 0].plot(ts["t"], np.array(ts["queue_total"]) / n_targets, label="mean per target")
    ax[0, 0].plot(ts["t"], ts["queue_max"], label="largest")
    ax[0, 0].set(xlabel="simulated s", ylabel="rows waiting", title="target queue depth")
    ax[0, 0].legend()
    ax[0, 1].plot(ts["t"], ts["util_mean"], label="mean")
    ax[0, 1].plot(ts["t"], ts["util_max"], label="busiest")
    ax[0, 1].set(xlabel="simulated s", ylabel="busy fraction", title="target utilisation", ylim=(0, 1.05))
    ax[0, 1].legend()
    ax[1, 0].plot(ts["t"], ts["tokens_per_s"], label="tokens/s")
    ax2 = ax[1, 0].twinx()
    ax2.plot(ts["t"], ts["active_sessions"], color="C2", label="active sessions")
    ax[1, 0].set(xlabel="simulated s", ylabel="tokens/s", title="throughput and load")
    ax2.set_ylabel("active sessions")
    for name, q in [("TTFT", "ttft_ms"), ("TPOT", "tpot_ms")]:
        p = result["summary"][q]
        ax[1, 1].bar([f"{name} p50", f"{name} p90", f"{name} p99"], [p["p50"], p["p90"], p["p99"]])
    ax[1, 1].set(ylabel="ms", title="latency percentiles", yscale="log")
    s = result["summary"]
    fig.suptitle(f"{sum(result['config']['clients'].values())} clients, {n_targets} targets, {result['config']['architecture']}, "
                 f"{result['config']['balancer']}: {s['throughput_tokens_per_s']:.0f} tokens/s, {100 * s['goodput_fraction']:.0f}% within SLO")  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(runs: list[dict], cfg: SimulateConfig, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sw = cfg.sweep
    fig, ax = plt.subplots(1, 4, figsize=(16, 3.8))
    panels = [
        ("TTFT p99 (ms)", lambda s: s["ttft_ms"]["p99"], "log"),
        ("TPOT p99 (ms)", lambda s: s["tpot_ms"]["p99"], "log"),
        ("requests within SLO (%)", lambda s: 100 * s["goodput_fraction"], "linear"),
        ("goodput (tokens/s)", lambda s: s["goodput_tokens_per_s"], "linear"),
    ]
    numeric = all(isinstance(r["value"], (int, float)) for r in runs)
    for other in dict.fromkeys(r["compare"] for r in runs):
        rs = [r for r in runs if r["compare"] == other]
        xs = [r["value"] if numeric else str(r["value"]) for r in rs]
        for a, (title, get, scale) in zip(ax, panels):
            a.plot(xs, [get(r["summary"]) for r in rs], marker="o", label=str(other) if other is not None else None)
            a.set(title=title, xlabel=sw.param, yscale=scale)
    if sw.compare:
        ax[0].legend(title=sw.compare)
    fig.suptitle(f"sweep of {sw.param}" + (f" by {sw.compare}" if sw.compare else "") + f", SLO TTFT <= {cfg.slo.ttft_ms:.0f} ms, TPOT <= {cfg.slo.tpot_ms:.0f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def to_json(data: Any) -> str:
    """Strict JSON: NaN (an empty percentile) becomes null."""

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return json.dumps(clean(data), indent=1)


CLI = Command("simulate", SimulateConfig, __doc__)
CLI.parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(argv: list[str] | None = None) -> int:
    return CLI.main(argv, run)


def run(cfg: SimulateConfig, args: argparse.Namespace) -> int:
    out = Path(cfg.output.dir)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.sweep.param:
        runs = run_sweep(args.config, args.overrides, cfg, progress=not args.no_progress)
        write_atomic(out / "sweep.json", to_json({"sweep": runs, "config": json.loads(to_json(vars(cfg.sweep)))}))
        write_atomic(out / "sweep.md", sweep_markdown(runs, cfg))
        if cfg.output.plots:
            plot_sweep(runs, cfg, out / "sweep.png")
        print(sweep_markdown(runs, cfg))
        print(f"wrote {out}/sweep.json, sweep.md" + (", sweep.png" if cfg.output.plots else ""))
        return 0
    result = simulate(cfg, load_scenario_profile(cfg), progress=not args.no_progress)
    write_atomic(out / "simulate.json", to_json(result))
    write_atomic(out / "simulate.md", markdown(result))
    if cfg.output.plots:
        plot(result, out / "simulate.png")
    print(markdown(result))
    print(f"wrote {out}/simulate.json, simulate.md" + (", simulate.png" if cfg.output.plots else ""))
    return 0


def _fmt(x: float | None) -> str:
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.0f}"


def _p(p: dict) -> str:
    return " / ".join(_fmt(p[q]) for q in ("p50", "p90", "p99"))


if __name__ == "__main__":
    sys.exit(main())
