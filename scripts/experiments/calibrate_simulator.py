"""Calibrate `simulate` against a real loopback load run of `serve` (fused and distributed).

    python scripts/experiments/calibrate_simulator.py --out runs/calibrate            # both architectures
    python scripts/experiments/calibrate_simulator.py --architectures fused --concurrency 4 --requests 48

For each architecture: start the server on 127.0.0.1 with small random Qwen2 models (built here,
never the bundled ones: a word-level tokenizer, so every streamed token is visible text, and a
draft that is the target's first layers, so it agrees often), run ``scripts/load_test.py``
against it, then measure the profile in the same run with the same models and engine settings
(every ``engine.step()`` of the server's static batch timed; distributed: through the still-running
target server, so the gRPC round trip is in the measured verification cost), take acceptance and
lengths from the load test's own rows (``serving.fleet.profile.from_load_test``), and simulate the same
closed loop (``--concurrency`` clients, no think time, one target, static batch, loopback link)
for the load test's wall time. Compared: throughput and p50 of TTFT, inter-token latency (TPOT)
and end-to-end latency; the goal is within 15%.

The distributed server (``serve --role draft`` + ``serve --role target``) batches every running
request of the draft node into one draft forward and one Verify call per step, so it is
simulated like a fused server whose verification cost is the measured round trip.

Load-test JSON fields used (scripts/load_test.py): ``wall_s``, ``throughput_tokens_per_s``,
``ttft_ms``/``itl_ms``/``e2e_ms`` percentiles (``p50``), ``concurrency``, ``rows[]`` with
``ok``, ``prompt_id``, ``prompt_tokens``, ``completion_tokens``, ``tokens_per_target_call``.
Writes ``calibration.json`` and ``calibration.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

REPO = Path(__file__).resolve().parents[2]

from serving.server.launch import free_port, stop, wait_healthy  # noqa: E402  (after the path above)


def word_tokenizer(vocab_size: int, n_prompts: int):
    """A word-level tokenizer over the load test's own prompts: every id decodes to a whole word,
    so each streamed step shows text at once. (A random model over a byte-level vocabulary emits
    partial UTF-8 that the server rightly holds back, which hides when tokens really arrive.)"""
    import re

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from serving.prompts import load_prompts

    from tests.conftest import CHAT_TEMPLATE, SPECIALS

    counts: dict[str, int] = {}
    for d in ("code", "chat", "math"):
        for p in load_prompts(d, n_prompts):
            for w in re.findall(r"\w+|[^\w\s]+", p.text):
                counts[w] = counts.get(w, 0) + 1
    words = sorted(counts, key=lambda w: (-counts[w], w))[: vocab_size - len(SPECIALS) - 1]
    words += [f"w{i}" for i in range(vocab_size - len(SPECIALS) - 1 - len(words))]
    vocab = {t: i for i, t in enumerate([*SPECIALS, "[UNK]", *words])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="[UNK]")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_models(root: Path, a: argparse.Namespace) -> tuple[Path, Path]:
    """A random target whose layers past the first ``draft_layers`` write to the residual stream
    at ``deep_scale`` of their random strength, and a draft made of those first layers (same
    embeddings and head): the draft agrees with the target often but not always, like a real pair."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    vocab = 384
    tokenizer = word_tokenizer(vocab, a.n_prompts)
    torch.manual_seed(a.seed)
    config = Qwen2Config(
        vocab_size=vocab, hidden_size=a.hidden, intermediate_size=4 * a.hidden, num_hidden_layers=a.layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )  # fmt: skip
    target = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in target.model.layers[a.draft_layers :]:
            layer.self_attn.o_proj.weight.mul_(a.deep_scale)
            layer.mlp.down_proj.weight.mul_(a.deep_scale)
    small = {k: v for k, v in config.to_dict().items() if k != "layer_types"} | {"num_hidden_layers": a.draft_layers}
    draft = Qwen2ForCausalLM(Qwen2Config(**small)).eval()
    draft.load_state_dict(target.state_dict(), strict=False)  # the first layers, embeddings, norm, head
    dirs = []
    for name, model in (("target", target), ("draft", draft)):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
        dirs.append(root / name)
    return dirs[0], dirs[1]


def write_router(root: Path, target: Path, draft: Path) -> Path:
    from routing.router import Router

    path = root / "router.pt"
    Router.create({"draft": str(draft), "none": None}, str(target)).save(path)
    return path


def start(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "serving.server.cli_serve", *args], stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO)


def server_totals(url: str) -> dict[str, tuple[float, float]]:
    """``{histogram: (count, sum)}`` of the server's Prometheus ``/metrics`` so far, for the
    engine step time (``choral_engine_step_seconds``) and the server-side time to first token
    (``choral_time_to_first_token_seconds``: from the request queued to its first tokens)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    totals = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("choral_engine_step_seconds", "choral_time_to_first_token_seconds"):
            count = sum(x.value for x in family.samples if x.name.endswith("_count"))
            total = sum(x.value for x in family.samples if x.name.endswith("_sum"))
            totals[family.name] = (count, total)
    return totals


def mean_ms(before: dict, after: dict, name: str) -> float:
    n = after[name][0] - before[name][0]
    return 1e3 * (after[name][1] - before[name][1]) / n if n else float("nan")


def serve_and_load(arch: str, target: Path, draft: Path, router: Path, out: Path, a: argparse.Namespace):
    """Start the server, run the load test against it, then measure the profile with the same
    models and settings (distributed: through the still-running target server, so the gRPC round
    trip is measured, not assumed) and stop it. Returns (load test JSON, profile)."""
    http = free_port()
    # step_k rows: the simulator models a server that verifies K every step (goodput would cap it by load).
    common = [f"engine.max_batch_size={a.batch}", f"engine.k={a.k}", "engine.step_k=rows", "log_level=warning", "engine.device=cpu"]
    procs = []
    grpc_address = None
    try:
        if arch == "distributed":
            grpc_port = free_port()
            grpc_address = f"127.0.0.1:{grpc_port}"
            procs.append(start(["--role", "target", "--router", str(router), "--port", str(grpc_port), *common], out / f"serve_target.log"))
            time.sleep(2.0)
            procs.append(start(["--role", "draft", "--target", grpc_address, "--router", str(router),
                                "--port", str(http), *common], out / f"serve_draft.log"))  # fmt: skip
        else:
            procs.append(start(["--router", str(router), "--port", str(http), *common], out / "serve_fused.log"))
        url = f"http://127.0.0.1:{http}"
        wait_healthy(url, procs[-1])
        load_out = out / f"load_{arch}"
        cmd = [sys.executable, str(REPO / "scripts" / "load_test.py"), "--url", url, "--concurrency", str(a.concurrency),
               "--requests", str(a.requests), "--max-tokens", str(a.max_tokens), "--draft", "draft",
               "--n-prompts", str(a.n_prompts), "--out", str(load_out), "--quiet"]  # fmt: skip
        before = server_totals(url)
        subprocess.run(cmd, check=False, cwd=REPO)
        after = server_totals(url)
        load = json.loads((load_out / "load_test.json").read_text())
        # The server's own step time during the load run (it shares the cores with the load
        # test's clients and its HTTP work, which a quiet profiling run does not see).
        load["server_step_ms"] = mean_ms(before, after, "choral_engine_step_seconds")
        load["server_ttft_mean_ms"] = mean_ms(before, after, "choral_time_to_first_token_seconds")
        stop(procs[1:])  # the draft node (distributed) or nothing; the target stays for the profile
        return load, measure_profile(target, draft, load, a, grpc_address)
    finally:
        stop(procs)


def measure_profile(target: Path, draft: Path, load: dict, a: argparse.Namespace, grpc_address: str | None = None):
    """Engine costs with the server's settings, timed the way the server's scheduler runs them:
    every load-test prompt queued on one engine with ``a.batch`` static slots and each
    ``engine.step()`` timed. A step that admits nobody costs K draft forwards plus one
    verification plus the engine's own work (and, distributed, the gRPC round trip); all but the
    draft forwards is the profile's verification cost. A step that admits requests costs that
    plus their prefills, shared out by prompt length. Acceptance and lengths come from the load
    test's rows."""
    import torch

    from serving.distributed.remote import RemoteVerifier
    from serving.engine.engine_settings import EngineSettings
    from serving.engine.loader import build_engine, prepare_kernels
    from serving.engine.request import Request
    from serving.engine.models import load_model, load_tokenizer
    from serving.fleet.profile import CostModel, CostPoint, DomainProfile, DraftProfile, Profile, from_load_test
    from serving.prompts import encode_prompt, load_prompts

    tok = load_tokenizer(str(target))
    cpu = torch.device("cpu")
    d_model = load_model(str(draft), dtype="float32", device=cpu)
    settings = EngineSettings(device="cpu", max_batch_size=a.batch, k=a.k, step_k="rows")
    widths = settings.engine_config(draft=True).step_widths
    if grpc_address:  # the draft keeps its fp32 numerics on the kernels, as the target would
        prepare_kernels(settings, [d_model], [], widths)
        engine = build_engine(settings, tok, RemoteVerifier(grpc_address), {"draft": d_model})
    else:
        t_model = load_model(str(target), dtype="float32", device=cpu)
        prepare_kernels(settings, [t_model, d_model], [], widths)
        engine = build_engine(settings, tok, t_model, {"draft": d_model})
    prompts = [p for d in ("code", "chat", "math") for p in load_prompts(d, a.n_prompts)]
    reqs = [Request(encode_prompt(tok, p), max_new_tokens=a.max_tokens) for p in prompts]
    engine.generate(reqs[: a.batch])  # warm-up
    ids = [engine.add_request(r) for r in reqs]
    prompt_len = dict(zip(ids, (len(r.prompt_ids) for r in reqs)))
    queued = list(ids)
    steps: list[tuple[float, list[int]]] = []  # (seconds, prompt lengths admitted in the step)
    stats: list[dict] = []
    while engine.has_unfinished_requests():
        waiting = engine.num_waiting
        t0 = time.perf_counter()
        outs = engine.step()
        wall = time.perf_counter() - t0
        admitted, queued = queued[: waiting - engine.num_waiting], queued[waiting - engine.num_waiting :]
        steps.append((wall, [prompt_len[i] for i in admitted]))
        stats += [o.finished.stats for o in outs if o.finished is not None and o.finished.stats["target_calls"]]
    if hasattr(engine, "close"):
        engine.close()
    quiet_step_ms = 1e3 * sum(w for w, _ in steps) / len(steps)
    draft_ms = statistics.median(s["draft_step_ms"] for s in stats)
    step_ms = 1e3 * statistics.median(w for w, adm in steps if not adm)
    verify_ms = step_ms - a.k * draft_ms
    pre = []
    for wall, adm in steps:
        extra = 1e3 * wall - step_ms
        if adm and extra > 0:
            pre += [CostPoint(1, n, extra * n / sum(adm), "prefill") for n in adm]
    base = Profile(
        target=CostModel.fit([CostPoint(a.batch, a.k + 1, verify_ms), *pre]),
        drafts={"draft": DraftProfile(cost=CostModel.fit([CostPoint(a.batch, 1, draft_ms)]), acceptance={"all": [0.5]})},
        domains={"all": DomainProfile()},  # replaced by the load test's measured lengths
    )
    profile = from_load_test(load, base=base, k=a.k)
    profile.meta |= {"mean_step_ms": quiet_step_ms, "step_ms_at_batch": step_ms, "verify_ms_at_batch": verify_ms, "draft_step_ms_at_batch": draft_ms,
                     "batch": a.batch, "k": a.k, "measured_through": grpc_address or "in-process engine"}  # fmt: skip
    return profile


def simulate_like(arch: str, load: dict, profile, a: argparse.Namespace) -> dict:
    """The load test's closed loop in the simulator. The profile's costs were measured on a quiet
    machine; under load the server's steps run slower (the load test's clients and the server's
    HTTP work share the cores), by the ratio of its mean step time during the run (``/metrics``)
    to the profiling run's: the simulated server runs at that speed (``--no-load-speed``: 1.0)."""
    from serving.config import load_config
    from serving.fleet.simulator import SimulateConfig, simulate

    speed = 1.0 if a.no_load_speed else profile.meta["mean_step_ms"] / load["server_step_ms"]
    profile.meta["load_speed"] = speed

    overrides = [
        f"duration_s={load['wall_s']}", "warmup_s=0", "metrics_interval_s=1", "architecture=fused",
        f"clients={{loop: {load['concurrency']}}}",
        "devices={loop: {draft_speed: 1.0, link: {latency_ms: 0.05, bandwidth_mbps: 10000}}}",
        f"targets=[{{count: 1, speed: {speed}, max_batch: {a.batch}, static_batch: true}}]",
        "arrivals.kind=closed", "arrivals.think_time_s=0", f"k.k={a.k}", "k.k_max=8", "draft.name=draft",
        f"seed={a.seed}", "output.plots=false",
    ]  # fmt: skip
    return simulate(load_config(SimulateConfig, None, overrides), profile)


def compare(load: dict, sim: dict) -> dict:
    s = sim["summary"]
    pairs = {
        "throughput_tokens_per_s": (load["throughput_tokens_per_s"], s["throughput_tokens_per_s"]),
        "ttft_p50_ms": (load["ttft_ms"]["p50"], s["ttft_ms"]["p50"]),
        "itl_p50_ms": (load["itl_ms"]["p50"], s["tpot_ms"]["p50"]),
        "e2e_p50_ms": (load["e2e_ms"]["p50"], s["e2e_ms"]["p50"]),
    }
    return {k: {"measured": m, "simulated": v, "error": (v - m) / m if m else None} for k, (m, v) in pairs.items()}


def markdown(report: dict) -> str:
    a = report["settings"]
    lines = [
        "# simulate calibration against a loopback load run of serve",
        "",
        f"Random Qwen2 target ({a['layers']} layers, hidden {a['hidden']}), draft = its first {a['draft_layers']} layers; "
        f"max_batch_size {a['batch']}, K {a['k']}, concurrency {a['concurrency']}, {a['requests']} requests of up to "
        f"{a['max_tokens']} tokens. Goal: |error| <= 15% on throughput and p50 latency.",
        "",
        "| architecture | metric | measured | simulated | error |",
        "|---|---|---|---|---|",
    ]
    for arch, r in report["results"].items():
        for metric, c in r["comparison"].items():
            err = "-" if c["error"] is None else f"{100 * c['error']:+.1f}%"
            lines.append(f"| {arch} | {metric} | {c['measured']:.1f} | {c['simulated']:.1f} | {err} |")
    lines += ["", "| architecture | mean acceptance | server step ms under load | profiling-run step ms | simulated speed | TTFT mean ms: client / server-side / simulated |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for arch, r in report["results"].items():
        lines.append(f"| {arch} | {r['acceptance']:.2f} | {r['server_step_ms']:.1f} | {r['quiet_step_ms']:.1f} | {r['load_speed']:.2f} | "
                     f"{r['client_ttft_mean_ms']:.0f} / {r['server_ttft_mean_ms']:.0f} / {r['simulated_ttft_mean_ms']:.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--architectures", default="fused,distributed")
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="the server's max_batch_size")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--n-prompts", type=int, default=8, help="prompts per domain")
    ap.add_argument("--no-load-speed", action="store_true", help="simulate at the quiet profile's speed")
    ap.add_argument("--deep-scale", type=float, default=0.15, help="strength of the target's layers past the draft's")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/calibrate")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    target, draft = build_models(out / "models", a)
    router = write_router(out, target, draft)
    report = {"settings": vars(a), "results": {}}
    for arch in [x for x in a.architectures.split(",") if x]:
        load, profile = serve_and_load(arch, target, draft, router, out, a)
        if load.get("errors"):
            print(f"{arch}: load test had {load['errors']} errors: {load.get('error_examples')}", file=sys.stderr)
        profile.save(out / f"profile_{arch}.yaml")
        sim = simulate_like(arch, load, profile, a)
        report["results"][arch] = {"comparison": compare(load, sim), "simulated": sim["summary"], "profile": str(out / f"profile_{arch}.yaml"),
                                   "server_step_ms": load["server_step_ms"], "quiet_step_ms": profile.meta["mean_step_ms"],
                                   "load_speed": profile.meta["load_speed"], "server_ttft_mean_ms": load["server_ttft_mean_ms"],
                                   "client_ttft_mean_ms": load["ttft_ms"]["mean"], "simulated_ttft_mean_ms": sim["summary"]["ttft_ms"]["mean"],
                                   "acceptance": statistics.fmean(r["acceptance"] for r in load["rows"] if r.get("ok"))}  # fmt: skip
        print(markdown(report))
    tmp = out / "calibration.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, out / "calibration.json")
    (out / "calibration.md").write_text(markdown(report))
    print(f"wrote {out}/calibration.json, calibration.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
