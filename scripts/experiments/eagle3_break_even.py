"""The ceiling issue 60 asks for before any EAGLE-3 training: from step costs measured on this
machine, how many tokens per target call a head of the measured cost needs to beat the 0.5B draft,
and to reach 1.4x the target alone.

Measured here, interleaved over ``--rounds`` (medians), each forward after a ``--prefill``-token
prompt in a static cache, on Choral's CPU kernels:

- the q4 target's one-token step (t1) and its (K+1)-token verify (tv);
- the 0.5B draft's one-token step at q4 (its default beside a q4 target: d) and at int8;
- an EAGLE-3 head's step (h): one decoder layer of the target's shape with a ``--draft-vocab``
  LM head (random weights of the real shapes, prepared as a draft at int8 and at q4), plus the
  3H -> H projection of the three target features timed as a Linear of the same precision.

A call drafts K tokens (K draft steps) and verifies once, so with tau tokens per call

    speedup = tau * t1 / (K * step + tv)

The 0.5B's tau comes from ``--draft-tau`` (e.g. spec-bench's tokens per call on code), or is
measured with ``--measure-tau N`` on N HumanEval prompts (greedy, q4 target, ``--max-new-tokens``).

    python scripts/experiments/eagle3_break_even.py --rounds 3 --measure-tau 6 --out runs/eagle3-break-even
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from serving.engine import cpu_kernels  # noqa: E402
from serving.engine.engine_settings import EngineSettings
from serving.engine.loader import load_models, prepare_kernels
from serving.engine.runner import ModelRunner  # noqa: E402

TARGET, DRAFT = "qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"


def step_ms(runner: ModelRunner, width: int, prefill: int, steps: int) -> float:
    """Median ms of ``steps`` forwards of ``width`` tokens after a ``prefill``-token prompt."""
    g = torch.Generator().manual_seed(0)
    high = min(20000, runner.model.config.vocab_size)  # token ids change no cost; a tiny test model has few
    runner.prefill(torch.randint(high // 200, high, (1, prefill), generator=g), slot=0)
    times, pos = [], prefill
    for i in range(steps + 2):  # two untimed warm-ups
        tokens = torch.randint(high // 200, high, (1, width), generator=g)  # [1, T]
        positions = torch.arange(pos, pos + width).unsqueeze(0)  # [1, T]
        t0 = time.perf_counter()
        runner.forward(tokens, positions)
        if i >= 2:
            times.append(time.perf_counter() - t0)
        pos = prefill  # rewrite the same positions: every step at the same context
    return statistics.median(times) * 1e3


def head_proxy(target_config, vocab: int, folder: Path, target_ref: str = TARGET) -> Path:
    """One decoder layer of the target's shape and a ``vocab``-token LM head, random weights."""
    from transformers import AutoTokenizer, Qwen2ForCausalLM

    from serving.engine.models import resolve_model_ref

    config = target_config.__class__.from_dict(target_config.to_dict())
    config.num_hidden_layers, config.vocab_size, config.tie_word_embeddings = 1, vocab, False
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):  # the target's ids lie past a 32k vocabulary
        if isinstance(getattr(config, name, None), int) and getattr(config, name) >= vocab:
            setattr(config, name, 0)
    config.layer_types = config.layer_types[:1] if getattr(config, "layer_types", None) else None
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(resolve_model_ref(target_ref)).save_pretrained(folder)  # the loaders want one
    return folder


def fc_ms(hidden: int, weights: str, steps: int) -> float:
    """The head's 3H -> H projection as a Linear of ``weights`` on the kernels, one row."""
    torch.manual_seed(0)
    lin = nn.Linear(3 * hidden, hidden, bias=False)
    mod = cpu_kernels.Int8Linear(lin) if weights == "int8" else cpu_kernels.Q4Linear(lin, cpu_kernels.q4_requantize(lin.weight))
    x = torch.randn(1, 3 * hidden)
    times = []
    for i in range(steps + 2):
        t0 = time.perf_counter()
        mod(x)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure_tau(n: int, k: int, max_new_tokens: int, target_ref: str = TARGET, draft_ref: str = DRAFT) -> float:
    """The 0.5B's tokens per target call on ``n`` HumanEval prompts at the default precisions."""
    from serving.engine import Request
    from serving.engine.loader import load_engine
    from serving.prompts import encode_prompt, load_prompts

    loaded = load_engine(EngineSettings(device="cpu", k=k), target_ref, {"draft": draft_ref})
    prompts = load_prompts("code", n)
    outs = loaded.engine.generate([Request(encode_prompt(loaded.tokenizer, p), max_new_tokens=max_new_tokens,
                                           drafter="draft") for p in prompts])  # fmt: skip
    return sum(o.stats["new_tokens"] for o in outs) / sum(o.stats["target_calls"] for o in outs)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=TARGET, help="the target (default: the bundled 1.5B)")
    p.add_argument("--draft", default=DRAFT, help="the draft model the head competes with (default: the bundled 0.5B)")
    p.add_argument("--k", type=int, default=4, help="draft tokens per call")
    p.add_argument("--draft-vocab", type=int, default=32000, help="the head's reduced vocabulary")
    p.add_argument("--prefill", type=int, default=150)
    p.add_argument("--steps", type=int, default=20, help="timed forwards per measurement")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians over them")
    p.add_argument("--draft-tau", type=float, default=None, help="the 0.5B's tokens per target call")
    p.add_argument("--measure-tau", type=int, default=0, metavar="N", help="measure it on N HumanEval prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default="runs/eagle3-break-even")
    args = p.parse_args(argv)
    if args.draft_tau is None and not args.measure_tau:
        p.error("give --draft-tau TAU or --measure-tau N")
    k = args.k
    widths = (1, k + 1)
    q4 = EngineSettings(device="cpu", target_weights="q4", draft_weights="q4").resolved(args.target)
    _, target, _ = load_models(q4, args.target)
    prepare_kernels(q4, [target], [], widths)
    drafts = {}
    for weights in ("q4", "int8"):  # the draft's default beside a q4 target, and the other choice
        s = EngineSettings(device="cpu", draft_weights=weights)
        _, drafts[weights], _ = load_models(s, args.draft)
        prepare_kernels(s, [], [drafts[weights]], widths)
    heads = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = head_proxy(target.config, args.draft_vocab, Path(tmp) / "head", args.target)
        for weights in ("int8", "q4"):
            s = EngineSettings(device="cpu", draft_weights=weights)
            _, head, _ = load_models(s, str(folder))
            prepare_kernels(s, [], [head], widths)
            heads[weights] = head
    hidden = target.config.hidden_size
    runners = {"target": ModelRunner(target, batch_size=1, max_len=args.prefill + 16),
               **{f"draft-{w}": ModelRunner(m, batch_size=1, max_len=args.prefill + 16) for w, m in drafts.items()}}
    runners |= {f"head-{w}": ModelRunner(m, batch_size=1, max_len=args.prefill + 16) for w, m in heads.items()}
    samples: dict[str, list[float]] = {}
    for r in range(args.rounds):  # interleaved: each round measures everything once
        print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        samples.setdefault("t1", []).append(step_ms(runners["target"], 1, args.prefill, args.steps))
        samples.setdefault("tv", []).append(step_ms(runners["target"], k + 1, args.prefill, args.steps))
        for w in drafts:
            samples.setdefault(f"d-{w}", []).append(step_ms(runners[f"draft-{w}"], 1, args.prefill, args.steps))
        for w in heads:
            layer = step_ms(runners[f"head-{w}"], 1, args.prefill, args.steps)
            samples.setdefault(f"h-{w}", []).append(layer + fc_ms(hidden, w, args.steps))
    ms = {name: statistics.median(v) for name, v in samples.items()}
    tau = (args.draft_tau if args.draft_tau is not None
           else measure_tau(args.measure_tau, k, args.max_new_tokens, args.target, args.draft))
    t1, tv, d = ms["t1"], ms["tv"], ms[f"d-{q4.draft_weights}"]
    draft_speedup = tau * t1 / (k * d + tv)
    rows = []
    for w in heads:
        h = ms[f"h-{w}"]
        call = k * h + tv
        rows.append({"head": f"EAGLE-3 head, {w}", "step_ms": h, "cost_of_step": h / t1,
                     "tau_to_beat_draft": draft_speedup * call / t1, "tau_for_1_15x_draft": 1.15 * draft_speedup * call / t1,
                     "tau_for_1_4x": 1.4 * call / t1, "tau_ceiling": k + 1, "speedup_at_tau_2": 2.0 * t1 / call})  # fmt: skip
    record = {
        "command": " ".join(["python", *sys.argv]) if argv is None else " ".join(["eagle3_break_even.py", *argv]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                    "capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__},
        "k": k, "draft_vocab": args.draft_vocab, "ms": ms, "samples_ms": samples, "verify_over_step": tv / t1,
        "draft": {"ref": args.draft, "weights": q4.draft_weights, "cost_of_step": d / t1, "tau": tau, "speedup": draft_speedup},
        "heads": rows,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "break_even.json").write_text(json.dumps(record, indent=2))
    print(f"q4 target: one-token step {t1:.1f} ms, {k + 1}-token verify {tv:.1f} ms ({tv / t1:.2f}x)")
    print(f"0.5B draft step: q4 {ms['d-q4']:.1f} ms, int8 {ms['d-int8']:.1f} ms")
    print(f"0.5B draft ({q4.draft_weights}, the default beside the q4 target): step {d:.1f} ms ({d / t1:.3f} of a target step), {tau:.2f} tokens per call, "
          f"{draft_speedup:.2f}x the target alone at K = {k}")
    print("| head | step ms | / target step | tau to beat the 0.5B | tau for 1.15x the 0.5B | tau for 1.4x | speedup at tau 2 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['head']} | {r['step_ms']:.1f} | {r['cost_of_step']:.3f} | {r['tau_to_beat_draft']:.2f} | "
              f"{r['tau_for_1_15x_draft']:.2f} | {r['tau_for_1_4x']:.2f} | {r['speedup_at_tau_2']:.2f}x |")
    print(f"(tokens per call are at most K + 1 = {k + 1})")
    return record


if __name__ == "__main__":
    main()
