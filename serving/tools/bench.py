"""spec-bench: target alone vs Choral speculative decoding vs Hugging Face assisted generation.

    spec-bench --target qwen2.5-coder-1.5b-instruct --draft qwen2.5-coder-0.5b-instruct \\
        --prompts-per-domain 10 --max-new-tokens 64 --out runs/bench

On the same prompts, models and precision, the three decoders run interleaved prompt by prompt
(their order rotating), so machine drift hits all of them alike. Per domain it reports tokens/s,
speedup over the target alone, acceptance, tokens per target call, the measured cost of a draft
step and of a (K+1)-token verification, the speedup those costs predict, and whether every output
equals the target's own greedy output; a differing output is explained by the target's top-2 logit
gap at the first differing token (a near-tie) or flagged as a bug. A K sweep follows. Writes
``bench.json``, ``bench.md`` and ``bench.png`` under ``--out``.

Flags map onto the settings (``--k`` is ``engine.k``, ``--no-hf`` is ``hf=false``; every one:
``spec-bench --describe``); ``--config FILE`` and ``key=value`` overrides work as on every command.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from tqdm import tqdm

from serving.cli import Command, Flag
from serving.config import ConfigError
from serving.engine import Request, SpeculativeEngine
from serving.engine.cpu_kernels import set_enabled
from serving.engine.engine_settings import EngineSettings, HOST_DRAFTERS
from serving.engine.loader import build_engine, load_models, prepare_kernels
from serving.engine.models import load_model
from serving.prompts import DOMAINS, encode_prompt, load_prompts, resolve_domains
from serving.workload import FAMILIES, load_family

NEAR_TIE = 1e-3  # a top-2 logit gap below this is a numerical tie, where rounding may pick either


def doc(text: str) -> dict:
    return {"doc": text}


@dataclass
class BenchConfig:
    target: str = field(default="qwen2.5-coder-1.5b-instruct", metadata=doc("target: hub id, folder or bundled name"))
    draft: str = field(default="qwen2.5-coder-0.5b-instruct", metadata=doc(
        "drafter: a draft model reference, or ngram / suffix (model-free; HF's peer is then its prompt lookup decoding)"))
    domains: list[Literal["code", "chat", "math", "edit", "extract", "summarize", "quoted", "grounded"]] = field(
        default_factory=lambda: list(DOMAINS), metadata=doc(
        "prompt domains (spec-bench's own prompts: the head rows of each); grounded = edit, extract, summarize, quoted"))
    families: list[Literal["chat", "code", "edit", "extract", "math", "quoted", "all"]] = field(default_factory=list, metadata=doc(
        "families of the six-family routing workload (serving.workload) instead of `domains`; all = the six"))
    split: Literal["train", "val", "test"] = field(default="test", metadata=doc("with `families`: the workload split to take"))
    prompts_per_domain: int = field(default=10, metadata=doc("prompts per domain (per family with `families`)"))
    max_new_tokens: int = field(default=64, metadata=doc("tokens generated per prompt, greedy"))
    k_sweep: list[int] = field(default_factory=lambda: list(range(1, 9)), metadata=doc("K values of the sweep; [] skips it"))
    sweep_prompts: int = field(default=2, metadata=doc("prompts per domain in the K sweep"))
    hf: bool = field(default=True, metadata=doc("also run Hugging Face assisted generation"))
    hf_kernels: Literal["stock", "choral"] = field(default="stock", metadata=doc(
        "kernels for HF assisted generation: stock transformers (what its users run) or Choral's (and Choral's draft weights)"))
    hf_draft_weights: Literal["fp32", "int8-dynamic"] = field(default="fp32", metadata=doc(
        "with hf_kernels=stock: HF's draft in fp32 or in PyTorch's own dynamic int8 (quantize_dynamic), the stock "
        "int8 path, to compare with Choral's int8 draft in the same precision"))
    out: str = field(default="runs/bench", metadata=doc("bench.json, bench.md and bench.png go here"))
    profile: str | None = field(default=None, metadata=doc(
        "also write a simulator profile (YAML/JSON) of this run: see serving/fleet/profile.py"))
    # Choral's engine: the target at target_weights (auto: fp32 beside the HF comparison, else q4 for a bundled
    # GGUF target on the CPU kernels), the draft fp32 unless draft_weights says otherwise (HF keeps an fp32
    # draft unless hf_kernels=choral).
    engine: EngineSettings = field(default_factory=lambda: EngineSettings(device="cpu", draft_weights="fp32"))

    def __post_init__(self) -> None:
        if not isinstance(self.engine.k, int):
            raise ValueError(f"engine.k={self.engine.k!r}: spec-bench measures a fixed K (and k_sweep); give an integer")
        if self.hf_draft_weights != "fp32" and (self.hf_kernels != "stock" or not self.hf or self.engine.quantize):
            raise ValueError("hf_draft_weights=int8-dynamic goes with hf_kernels=stock, hf=true and no engine.quantize")
        for name in ("prompts_per_domain", "max_new_tokens", "sweep_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not self.domains:
            raise ValueError("domains must name at least one domain (code, chat, math, edit, extract, summarize, quoted or grounded)")


@torch.no_grad()
def top2_gap(model, prompt_ids: list[int], prefix: list[int]) -> float:
    """The target's own margin between its two best next tokens after prompt + prefix."""
    logits = model(torch.tensor([prompt_ids + prefix], device=model.device)).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])


def compare(model, prompt_ids, reference: list[int], output: list[int]) -> dict:
    """Identical, or where the first difference is and whether it is a near-tie of the target."""
    if output == reference:
        return {"identical": True}
    i = next((j for j, (a, b) in enumerate(zip(reference, output)) if a != b), min(len(reference), len(output)))
    gap = top2_gap(model, prompt_ids, reference[:i])
    return {"identical": False, "first_diff": i, "top2_gap": gap, "near_tie": gap < NEAR_TIE}


def hf_assisted(target, draft, prompt_ids: list[int], max_new: int, eos: list[int], stock: bool) -> tuple[list[int], float]:
    """transformers' assisted generation. ``stock``: with the library's own kernels, as its users
    run it, even when Choral's CPU kernels are installed in the shared model objects."""
    ids = torch.tensor([prompt_ids], device=target.device)
    # A model-free drafter's peer is transformers' prompt lookup decoding (draft = its K).
    assist = {"prompt_lookup_num_tokens": draft} if isinstance(draft, int) else {"assistant_model": draft}
    models = [m for m in (target, draft) if isinstance(m, torch.nn.Module)]
    for model in models:
        set_enabled(model, not stock)
    try:
        start = time.perf_counter()
        out = target.generate(
            ids, **assist, max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
        )  # fmt: skip
        seconds = time.perf_counter() - start
    finally:
        for model in models:
            set_enabled(model, True)
    return out[0, len(prompt_ids) :].tolist(), seconds


def run_engine(engine: SpeculativeEngine, prompt_ids: list[int], max_new: int) -> tuple[list[int], dict]:
    [out] = engine.generate([Request(prompt_ids, max_new_tokens=max_new)])
    return out.token_ids, out.stats


def summarize(rows: list[dict]) -> dict:
    def total_rate(key_tokens, key_time):
        return sum(r[key_tokens] for r in rows) / sum(r[key_time] for r in rows)

    target_tps = total_rate("target_tokens", "target_s")
    spec_tps = total_rate("spec_tokens", "spec_s")
    t1 = statistics.median(r["target_step_ms"] for r in rows)  # one-token target step
    tv = statistics.median(r["verify_ms"] for r in rows)  # (K+1)-token verification
    td = statistics.median(r["draft_step_ms"] for r in rows)
    drafted = sum(r["drafted"] for r in rows)
    calls = sum(r["target_calls"] for r in rows)
    per_call = sum(r["spec_tokens"] - 1 for r in rows) / calls
    drafts_per_call = drafted / calls  # K, or fewer on average with a draft-confidence stop
    predicted = per_call * t1 / (drafts_per_call * td + tv)
    # Decode phase only (prefill excluded on both sides): what the step costs predict.
    decode_speedup = sum(r["target_decode_s"] for r in rows) / sum(r["spec_decode_s"] for r in rows)
    out = {
        "prompts": len(rows),
        "target_tokens_per_s": target_tps,
        "choral_tokens_per_s": spec_tps,
        "choral_speedup": spec_tps / target_tps,
        "acceptance_rate": sum(r["accepted"] for r in rows) / drafted if drafted else 0.0,
        "tokens_per_target_call": per_call,
        "target_step_ms": t1,
        "verify_ms": tv,
        "verify_cost_ratio": tv / t1,
        "draft_step_ms": td,
        "drafted_per_call": drafts_per_call,
        "predicted_speedup": predicted,
        "decode_speedup": decode_speedup,
        "overhead_ratio": decode_speedup / predicted,
        "choral_identical": sum(r["choral_check"]["identical"] for r in rows),
        "choral_near_ties": sum(not r["choral_check"]["identical"] and r["choral_check"]["near_tie"] for r in rows),
    }
    if rows and "hf_s" in rows[0]:
        hf_tps = total_rate("hf_tokens", "hf_s")
        out |= {
            "hf_tokens_per_s": hf_tps,
            "hf_speedup": hf_tps / target_tps,
            "choral_vs_hf": spec_tps / hf_tps,
            "hf_identical": sum(r["hf_check"]["identical"] for r in rows),
        }
    return out


def bench_prompt(engines, models, prompt_ids, max_new, eos, order: int, with_hf: bool, hf_stock: bool = True) -> dict:
    target_engine, spec_engine = engines
    target, draft = models
    row: dict = {"prompt_tokens": len(prompt_ids)}
    runs = ["target", "spec", "hf"] if with_hf else ["target", "spec"]
    runs = runs[order % len(runs) :] + runs[: order % len(runs)]  # rotate who goes first
    for name in runs:
        if name == "target":
            ids, s = run_engine(target_engine, prompt_ids, max_new)
            row |= {"target_ids": ids, "target_tokens": len(ids), "target_s": s["total_time_s"],
                    "target_decode_s": s["total_time_s"] - s["prefill_time_s"], "target_step_ms": s["target_step_ms"]}  # fmt: skip
        elif name == "spec":
            ids, s = run_engine(spec_engine, prompt_ids, max_new)
            row |= {"spec_ids": ids, "spec_tokens": len(ids), "spec_s": s["total_time_s"],
                    "spec_decode_s": s["total_time_s"] - s["prefill_time_s"], "verify_ms": s["target_step_ms"],
                    "draft_step_ms": s["draft_step_ms"], "drafted": s["drafted"], "accepted": s["accepted"],
                    "target_calls": s["target_calls"], "per_position_acceptance": s["per_position_acceptance"]}  # fmt: skip
        else:
            ids, seconds = hf_assisted(target, draft, prompt_ids, max_new, eos, hf_stock)
            row |= {"hf_ids": ids, "hf_tokens": len(ids), "hf_s": seconds}
    row["choral_check"] = compare(target, prompt_ids, row["target_ids"], row["spec_ids"])
    if with_hf:
        row["hf_check"] = compare(target, prompt_ids, row["target_ids"], row["hf_ids"])
    return row


def markdown(report: dict) -> str:
    cfg = report["config"]
    lines = [
        f"# spec-bench: {cfg['target']} with draft {cfg['draft']}",
        "",
        f"{cfg['dtype']} on {cfg['device']} ({cfg['machine']}), greedy, {cfg['max_new_tokens']} new tokens, "
        f"K={cfg['k']}, draft confidence stop: {cfg.get('draft_confidence')} ({cfg.get('draft_stop', 'token')}), {cfg['prompts_per_domain']} prompts per domain, Choral CPU kernels: "
        f"{cfg.get('choral_cpu_kernels')}, Choral's target weights: {cfg.get('target_weights', 'fp32')}, draft weights: {cfg.get('draft_weights', 'fp32')}, HF assisted kernels: {cfg['hf_kernels']} "
        f"(draft weights: {cfg.get('draft_weights', 'fp32') if cfg['hf_kernels'] == 'choral' else cfg.get('hf_draft_weights', 'fp32')}). Command: `{cfg['command']}`",
        "",
        "| domain | target tok/s | HF assisted tok/s | Choral tok/s | Choral speedup | Choral / HF | acceptance "
        "| tokens/target call | drafted/call | draft step ms | 1-token step ms | verify ms | verify / 1-token | predicted speedup "
        "| decode speedup / predicted | identical to target |",
        "|" + "---|" * 16,
    ]
    for domain, s in report["summary"].items():
        hf = f"{s['hf_tokens_per_s']:.2f}" if "hf_tokens_per_s" in s else "-"
        vs = f"{s['choral_vs_hf']:.2f}x" if "choral_vs_hf" in s else "-"
        ident = f"{s['choral_identical']}/{s['prompts']}"
        if s["choral_near_ties"]:
            ident += f" (+{s['choral_near_ties']} near-tie)"
        lines.append(
            f"| {domain} | {s['target_tokens_per_s']:.2f} | {hf} | {s['choral_tokens_per_s']:.2f} | "
            f"{s['choral_speedup']:.2f}x | {vs} | {s['acceptance_rate']:.2f} | {s['tokens_per_target_call']:.2f} | "
            f"{s['drafted_per_call']:.2f} | {s['draft_step_ms']:.0f} | {s['target_step_ms']:.0f} | {s['verify_ms']:.0f} | {s['verify_cost_ratio']:.2f}x | "
            f"{s['predicted_speedup']:.2f}x | {s['overhead_ratio']:.2f} | {ident} |"
        )
    diffs = [(d, i, r["choral_check"]) for d, rows in report["rows"].items() for i, r in enumerate(rows)
             if not r["choral_check"]["identical"]]  # fmt: skip
    if diffs:
        lines += ["", "Outputs that differ from the target alone (first differing token, target's top-2 logit gap):", ""]
        lines += [f"- {d} prompt {i}: token {c['first_diff']}, gap {c['top2_gap']:.2e} "
                  f"({'near-tie' if c['near_tie'] else 'NOT a near-tie: bug'})" for d, i, c in diffs]  # fmt: skip
    if report.get("k_sweep"):
        lines += ["", "K sweep (Choral, same prompts subset):", "", "| K | domain | acceptance | tokens/target call | speedup |", "|---|---|---|---|---|"]
        for r in report["k_sweep"]:
            lines.append(f"| {r['k']} | {r['domain']} | {r['acceptance_rate']:.2f} | {r['tokens_per_target_call']:.2f} | {r['speedup']:.2f}x |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    domains = list(report["summary"])
    methods = [("hf_speedup", "HF assisted"), ("choral_speedup", "Choral"), ("predicted_speedup", "predicted")]
    width = 0.25
    for j, (key, label) in enumerate(methods):
        vals = [report["summary"][d].get(key, 0.0) for d in domains]
        axes[0].bar([i + j * width for i in range(len(domains))], vals, width, label=label)
    axes[0].axhline(1.0, color="gray", lw=0.8)
    axes[0].set_xticks([i + width for i in range(len(domains))], domains)
    axes[0].set_ylabel("speedup over target alone")
    axes[0].legend()
    for d in {r["domain"] for r in report.get("k_sweep", [])}:
        pts = sorted((r["k"], r["speedup"]) for r in report["k_sweep"] if r["domain"] == d)
        axes[1].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=d)
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set_xlabel("K (draft tokens per step)")
    axes[1].set_ylabel("speedup over target alone")
    axes[1].legend()
    fig.suptitle(f"{report['config']['target']} / {report['config']['draft']}, {report['config']['dtype']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


CLI = Command("spec-bench", BenchConfig, __doc__, flags=[
    Flag("--target", "target"),
    Flag("--draft", "draft"),
    Flag("--domains", "domains", sep=","),
    Flag("--families", "families", sep=","),
    Flag("--split", "split"),
    Flag("--prompts-per-domain", "prompts_per_domain"),
    Flag("--max-new-tokens", "max_new_tokens"),
    Flag("--k", "engine.k"),
    Flag("--draft-confidence", "engine.draft_confidence"),
    Flag("--draft-stop", "engine.draft_stop"),
    Flag("--k-sweep", "k_sweep", sep=",", help="comma list of K values; empty to skip"),
    Flag("--sweep-prompts", "sweep_prompts"),
    Flag("--no-hf", "hf", const=False, help="skip Hugging Face assisted generation"),
    Flag("--device", "engine.device"),
    Flag("--dtype", "engine.dtype"),
    Flag("--quantize", "engine.quantize"),
    Flag("--draft-weights", "engine.draft_weights"),
    Flag("--target-weights", "engine.target_weights"),
    Flag("--compile", "engine.compile_backend", const="auto", help="compile the step shapes"),
    Flag("--no-cpu-kernels", "engine.cpu_kernels", const=False, help="Choral on stock PyTorch CPU kernels"),
    Flag("--hf-kernels", "hf_kernels"),
    Flag("--hf-draft-weights", "hf_draft_weights"),
    Flag("--max-len", "engine.max_len"),
    Flag("--out", "out"),
    Flag("--profile", "profile"),
])  # fmt: skip
CLI.parser.add_argument("--from-json", metavar="BENCH_JSON", help="re-render the summary, table and plot of a saved bench.json (no runs)")


def main(argv: list[str] | None = None) -> int:
    return CLI.main(argv, lambda cfg, args: run(cfg, args, argv))


@dataclass
class _Setup:
    """What a run loads once: the settings that run (never auto), the tokenizer, the target, the
    draft Choral runs and the one transformers runs beside it."""

    cfg: BenchConfig
    e: EngineSettings
    host: bool  # ngram or suffix: no draft model; HF's peer is prompt lookup
    tokenizer: Any
    target: Any
    choral_draft: Any  # the draft model, or for a host drafter its k
    hf_draft: Any
    cpu_kernels: bool

    def settings(self, k: int) -> EngineSettings:
        """The settings of the engine at ``k`` (0: the target alone); every K of the sweep is a bucket."""
        top = max([k, *self.cfg.k_sweep])
        return dataclasses.replace(self.e, k=max(k, 1), k_buckets=tuple(range(1, top + 1)) if k else (1,))

    def engine(self, k: int) -> SpeculativeEngine:
        drafter = self.cfg.draft if self.host else self.choral_draft
        return build_engine(self.settings(k), self.tokenizer, self.target, {self.cfg.draft: drafter} if k else {})


def _setup(cfg: BenchConfig) -> _Setup:
    e = cfg.engine
    if e.target_weights == "auto" and cfg.hf:
        # The comparison, transformers' assisted generation, runs the fp32 weights its users load;
        # beside it the target runs fp32 too. --no-hf runs auto's choice (q4 for a bundled target).
        e = dataclasses.replace(e, target_weights="fp32")
    e = e.resolved(cfg.target)  # what runs, never auto
    print(e.precision_line(cfg.target), file=sys.stderr, flush=True)
    host = cfg.draft in HOST_DRAFTERS
    tokenizer, target, drafts = load_models(e, cfg.target, [] if host else [cfg.draft])
    draft = e.k if host else drafts[cfg.draft]
    device = target.device
    # With stock kernels HF assisted generation keeps an fp32 draft (its users' setup); with
    # hf_kernels=choral it runs the very draft Choral runs, int8 included (same precision).
    # hf_draft_weights=int8-dynamic gives HF its own int8 draft, PyTorch's stock dynamic int8.
    hf_int8 = cfg.hf_draft_weights != "fp32"
    choral_draft = draft
    if not host and e.draft_weights != "fp32" and cfg.hf and cfg.hf_kernels == "stock" and not hf_int8:
        choral_draft = load_model(cfg.draft, dtype=e.dtype, device=device, quantize=e.quantize)  # the kernels change it in place
    hf_draft = draft if cfg.hf_kernels == "stock" else choral_draft
    if hf_int8 and not host:
        hf_draft = load_model(cfg.draft, dtype=e.dtype, device=device, quantize=cfg.hf_draft_weights)
    setup = _Setup(cfg, e, host, tokenizer, target, choral_draft, hf_draft, False)
    # Every K of the run and the sweep is a step width the kernels must know.
    widths = setup.settings(max([e.k, *cfg.k_sweep])).engine_config(draft=True, device=device, k="auto").step_widths
    try:
        setup.cpu_kernels = prepare_kernels(e, [target], [] if host else [choral_draft], widths)
    except ValueError as error:  # int8 drafts where the kernels do not apply
        raise ConfigError(f"engine.{error}") from None
    return setup


def run(cfg: BenchConfig, args: argparse.Namespace, argv: list[str] | None = None) -> int:
    out_dir = Path(cfg.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.from_json:
        report = json.loads(Path(args.from_json).read_text())
        report["config"]["profile"] = cfg.profile
        report["summary"] = {d: summarize(rows) for d, rows in report["rows"].items()}
        report["summary"]["all"] = summarize([r for rows in report["rows"].values() for r in rows])
        return write_report(report, out_dir)
    setup = _setup(cfg)
    e, tokenizer = setup.e, setup.tokenizer
    target_engine, spec_engine = setup.engine(0), setup.engine(e.k)
    eos = sorted(target_engine._eos)
    if cfg.families:  # the routing workload's families, from one split
        domains = list(FAMILIES) if "all" in cfg.families else list(dict.fromkeys(cfg.families))
        prompts = {f: load_family(f, cfg.split, cfg.prompts_per_domain) for f in domains}
    else:
        domains = resolve_domains(cfg.domains)  # groups (grounded) expand to their domains
        prompts = {d: load_prompts(d, cfg.prompts_per_domain) for d in domains}
    settings = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "engine"} | dataclasses.asdict(e)
    report: dict = {
        # Flat, as bench.json always was: the run's settings (engine ones included) and where it ran.
        "config": settings | {"draft_weights": e.draft_weights if setup.cpu_kernels else "fp32", "no_hf": not cfg.hf,
                              "machine": f"{platform.machine()} {platform.processor() or ''} {torch.get_num_threads()} threads".strip(),
                              "command": " ".join(["spec-bench", *(argv if argv is not None else sys.argv[1:])]),
                              "torch": torch.__version__, "choral_cpu_kernels": setup.cpu_kernels},  # fmt: skip
        "rows": {},
        "summary": {},
    }
    engines, models, stock = (target_engine, spec_engine), (setup.target, setup.hf_draft), cfg.hf_kernels == "stock"
    # One untimed pass of each decoder first: allocator, thread pools and lazy inits warm up.
    bench_prompt(engines, models, encode_prompt(tokenizer, prompts[domains[0]][0]), 8, eos, 0, cfg.hf, stock)
    with tqdm(total=sum(len(p) for p in prompts.values()), desc="spec-bench", unit="prompt") as bar:
        for d in domains:
            rows = []
            for i, prompt in enumerate(prompts[d]):
                row = bench_prompt(engines, models, encode_prompt(tokenizer, prompt), cfg.max_new_tokens, eos, i, cfg.hf, stock)
                rows.append(row | {"id": prompt.id})
                bar.update(1)
                bar.set_postfix(domain=d, identical=row["choral_check"]["identical"])
            report["rows"][d] = rows
            report["summary"][d] = summarize(rows)
    report["summary"]["all"] = summarize([r for rows in report["rows"].values() for r in rows])
    report["k_sweep"] = k_sweep(setup, domains, prompts, report["rows"])
    return write_report(report, out_dir)


def k_sweep(setup: _Setup, domains: list[str], prompts: dict, rows_by_domain: dict) -> list[dict]:
    """Acceptance, tokens per target call and speedup over the target alone at each K of the sweep,
    on each domain's first ``sweep_prompts`` prompts (the target's times from the main pass)."""
    cfg, out = setup.cfg, []
    for k in tqdm(cfg.k_sweep, desc="K sweep"):
        sweep_engine = setup.engine(k)
        for d in domains:
            rows = rows_by_domain[d][: cfg.sweep_prompts]
            stats = [run_engine(sweep_engine, encode_prompt(setup.tokenizer, prompts[d][i]), cfg.max_new_tokens)[1]
                     for i in range(len(rows))]  # fmt: skip
            spec_s = sum(s["total_time_s"] for s in stats)
            out.append({
                "k": k, "domain": d,
                "acceptance_rate": sum(s["accepted"] for s in stats) / max(1, sum(s["drafted"] for s in stats)),
                "tokens_per_target_call": sum(s["new_tokens"] - 1 for s in stats) / max(1, sum(s["target_calls"] for s in stats)),
                "speedup": (sum(r["target_s"] for r in rows) / sum(r["target_tokens"] for r in rows))
                / (spec_s / sum(s["new_tokens"] for s in stats)),
            })  # fmt: skip
    return out


def write_report(report: dict, out_dir: Path) -> int:
    (out_dir / "bench.json").write_text(json.dumps(report, indent=1))
    if report["config"].get("profile"):
        from serving.fleet.profile import from_bench

        print(f"wrote profile {from_bench(report).save(report['config']['profile'])}")
    (out_dir / "bench.md").write_text(markdown(report))
    plot(report, out_dir / "bench.png")
    print(markdown(report))
    print(f"wrote {out_dir}/bench.json, bench.md, bench.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
