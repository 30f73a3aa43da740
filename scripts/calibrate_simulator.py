"""Calibrate `simulate` against a real loopback load run of `serve` (fused and distributed).

    python scripts/calibrate_simulator.py --out runs/calibrate            # both architectures
    python scripts/calibrate_simulator.py --architectures fused --concurrency 4 --requests 48

For each architecture: start the server on 127.0.0.1 with small random Qwen2 models (built here,
never the bundled ones), run ``scripts/load_test.py`` against it, stop it, then measure the
profile in the same run with the same models and engine settings (``SpeculativeEngine`` with the
server's static batch: the verification and draft step costs at ``max_batch_size`` rows, the
prefill cost per prompt token), take acceptance and lengths from the load test's own rows
(``serving.profile.from_load_test``), and simulate the same closed loop (``--concurrency``
clients, no think time, one target, static batch, loopback link) for the load test's wall
time. Compared: throughput and p50 of TTFT, inter-token latency (TPOT) and end-to-end latency;
the goal is within 15%.

The distributed server (``serve --role draft`` + ``serve --role target``) batches every running
request of the draft node into one draft forward and one Verify call per step, so it is
simulated like a fused server whose step also pays the gRPC round trip
(``targets[0].step_overhead_ms``; ``--grpc-overhead-ms``, default 1 ms, an assumption, not fitted).

Load-test JSON fields used (scripts/load_test.py): ``wall_s``, ``throughput_tokens_per_s``,
``ttft_ms``/``itl_ms``/``e2e_ms`` percentiles (``p50``), ``concurrency``, ``rows[]`` with
``ok``, ``prompt_id``, ``prompt_tokens``, ``completion_tokens``, ``tokens_per_target_call``.
Writes ``calibration.json`` and ``calibration.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_models(root: Path, hidden: int, layers: int, draft_layers: int, seed: int) -> tuple[Path, Path]:
    """A random target and a draft made of its first ``draft_layers`` layers (same embeddings
    and head), so the draft agrees with the target often but not always."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tests.conftest import make_tokenizer

    tokenizer = make_tokenizer()
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=384, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
        eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    target = Qwen2ForCausalLM(config).eval()
    small = {k: v for k, v in config.to_dict().items() if k != "layer_types"} | {"num_hidden_layers": draft_layers}
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


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300.0) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"{url} not healthy after {timeout:.0f} s")


def start(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "serving.cli_serve", *args], stdout=log.open("w"), stderr=subprocess.STDOUT, cwd=REPO)


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def serve_and_load(arch: str, router: Path, out: Path, a: argparse.Namespace) -> dict:
    http = free_port()
    common = [f"max_batch_size={a.batch}", f"k={a.k}", "log_level=warning", "device=cpu"]
    procs = []
    try:
        if arch == "distributed":
            grpc_port = free_port()
            procs.append(start(["--role", "target", "--router", str(router), "--port", str(grpc_port), *common], out / f"serve_target.log"))
            time.sleep(2.0)
            procs.append(start(["--role", "draft", "--target", f"127.0.0.1:{grpc_port}", "--router", str(router),
                                "--port", str(http), *common], out / f"serve_draft.log"))  # fmt: skip
        else:
            procs.append(start(["--router", str(router), "--port", str(http), *common], out / "serve_fused.log"))
        url = f"http://127.0.0.1:{http}"
        wait_healthy(url, procs[-1])
        load_out = out / f"load_{arch}"
        cmd = [sys.executable, str(REPO / "scripts" / "load_test.py"), "--url", url, "--concurrency", str(a.concurrency),
               "--requests", str(a.requests), "--max-tokens", str(a.max_tokens), "--draft", "draft",
               "--n-prompts", str(a.n_prompts), "--out", str(load_out), "--quiet"]  # fmt: skip
        subprocess.run(cmd, check=False, cwd=REPO)
        return json.loads((load_out / "load_test.json").read_text())
    finally:
        stop(procs)


def measure_profile(target: Path, draft: Path, load: dict, a: argparse.Namespace):
    """Engine costs with the server's settings (static batch of ``a.batch`` rows), acceptance and
    lengths from the load test's rows."""
    import torch

    from serving.engine import EngineConfig, Request, SpeculativeEngine, use_cpu_kernels
    from serving.models import load_model, load_tokenizer
    from serving.profile import CostModel, CostPoint, DomainProfile, DraftProfile, Profile, from_load_test
    from serving.prompts import encode_prompt, load_prompts

    tok = load_tokenizer(str(target))
    t_model, d_model = load_model(str(target), dtype="float32", device=torch.device("cpu")), load_model(str(draft), dtype="float32", device=torch.device("cpu"))
    cfg = EngineConfig(max_batch_size=a.batch, k=a.k)
    use_cpu_kernels([t_model, d_model], device=torch.device("cpu"), dtype="float32", widths=cfg.step_widths)
    engine = SpeculativeEngine(t_model, tok, d_model, cfg)
    prompts = [p for d in ("code", "chat", "math") for p in load_prompts(d, a.n_prompts)]
    reqs = [Request(encode_prompt(tok, p), max_new_tokens=a.max_tokens) for p in prompts]
    engine.generate(reqs[: a.batch])  # warm-up
    outs = engine.generate(reqs)
    stats = [o.stats for o in outs if o.stats["target_calls"]]
    verify_ms = statistics.median(s["target_step_ms"] for s in stats)
    draft_ms = statistics.median(s["draft_step_ms"] for s in stats)
    # Prefill (target and draft, one request at a time) per prompt token.
    pre = [CostPoint(1, len(r.prompt_ids), 1e3 * o.stats["prefill_time_s"], "prefill") for r, o in zip(reqs, outs)]
    base = Profile(
        target=CostModel.fit([CostPoint(a.batch, a.k + 1, verify_ms), *pre]),
        drafts={"draft": DraftProfile(cost=CostModel.fit([CostPoint(a.batch, 1, draft_ms)]), acceptance={"all": [0.5]})},
        domains={"all": DomainProfile()},  # replaced by the load test's measured lengths
    )
    profile = from_load_test(load, base=base, k=a.k)
    profile.meta |= {"verify_ms_at_batch": verify_ms, "draft_step_ms_at_batch": draft_ms, "batch": a.batch, "k": a.k}
    return profile


def simulate_like(arch: str, load: dict, profile, a: argparse.Namespace) -> dict:
    from serving.config import load_config
    from serving.simulator import SimulateConfig, simulate

    overhead = a.grpc_overhead_ms if arch == "distributed" else 0.0
    overrides = [
        f"duration_s={load['wall_s']}", "warmup_s=0", "metrics_interval_s=1", "architecture=fused",
        f"clients={{loop: {load['concurrency']}}}",
        "devices={loop: {draft_speed: 1.0, link: {latency_ms: 0.05, bandwidth_mbps: 10000}}}",
        f"targets=[{{count: 1, speed: 1.0, max_batch: {a.batch}, static_batch: true, step_overhead_ms: {overhead}}}]",
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
    ap.add_argument("--grpc-overhead-ms", type=float, default=1.0, help="distributed: gRPC round trip added to every step")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="runs/calibrate")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    target, draft = build_models(out / "models", a.hidden, a.layers, a.draft_layers, a.seed)
    router = write_router(out, target, draft)
    report = {"settings": vars(a), "results": {}}
    for arch in [x for x in a.architectures.split(",") if x]:
        load = serve_and_load(arch, router, out, a)
        if load.get("errors"):
            print(f"{arch}: load test had {load['errors']} errors: {load.get('error_examples')}", file=sys.stderr)
        profile = measure_profile(target, draft, load, a)
        profile.save(out / f"profile_{arch}.yaml")
        sim = simulate_like(arch, load, profile, a)
        report["results"][arch] = {"comparison": compare(load, sim), "simulated": sim["summary"], "profile": str(out / f"profile_{arch}.yaml")}
        print(markdown(report))
    tmp = out / "calibration.json.tmp"
    tmp.write_text(json.dumps(report, indent=1, default=str))
    os.replace(tmp, out / "calibration.json")
    (out / "calibration.md").write_text(markdown(report))
    print(f"wrote {out}/calibration.json, calibration.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
