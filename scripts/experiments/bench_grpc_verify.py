"""Cost of one verify round trip over gRPC on loopback, against the same verification run locally.

    python scripts/experiments/bench_grpc_verify.py --out runs/bench_grpc_verify.json
    python scripts/experiments/bench_grpc_verify.py --vocab 151936          # Qwen's vocabulary: q is 2.4 MB a row
    python scripts/experiments/bench_grpc_verify.py --target-address 127.0.0.1:50051   # a `serve --role target`

For each (batch, greedy/sampled) the same requests run through the fused engine and through a
draft node (SpeculativeEngine on a RemoteVerifier) talking to a VerifyServer in this process (separate thread,
real gRPC over 127.0.0.1). Reported per verify call, in ms:
  local_forward: the fused engine's target forward (stats target_step_ms);
  rpc_round_trip: the draft node's Verify call, request built to answer decoded;
  target_side: what the service spent on the call (queue, batching window, forward, accept/commit);
  overhead = rpc_round_trip - target_side: serialization, transport and gRPC's threads.
Tiny random models built from a config (no download); sampled rows send q, float32 [K, V] each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from serving.distributed.remote import RemoteVerifier
from serving.distributed.verify_service import VerifyServer
from serving.engine import EngineSettings, Request, build_engine
from serving.engine.sampling import SamplingParams


def tiny_pair(vocab: int, hidden: int, layers: int) -> tuple[Qwen2ForCausalLM, Qwen2ForCausalLM, PreTrainedTokenizerFast]:
    def model(seed: int, n_layers: int) -> Qwen2ForCausalLM:
        torch.manual_seed(seed)
        config = Qwen2Config(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=n_layers,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, eos_token_id=vocab - 1,
            tie_word_embeddings=False,
        )  # fmt: skip
        return Qwen2ForCausalLM(config).eval()

    target = model(0, layers)
    draft = Qwen2ForCausalLM(target.config).eval()  # the target plus noise: accepts some, not all
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.3 * p.std().clamp(min=1e-3))
    words = {f"t{i}": i for i in range(vocab - 1)} | {"<eos>": vocab - 1}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(words, unk_token="t0")), eos_token="<eos>")
    return target, draft, tokenizer


def measure(target, draft, tokenizer, address: str | None, batch: int, sampled: bool, k: int, new_tokens: int,
            window_ms: float) -> dict:
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0.8, seed=1) if sampled else SamplingParams()
    requests = [
        Request(torch.randint(0, 300, (16,), generator=g).tolist(), params=params, max_new_tokens=new_tokens)
        for _ in range(batch)
    ]
    config = EngineSettings(device="cpu", max_batch_size=batch, max_len=new_tokens + 16 + k + 1, k=k)
    server = None
    if address is None:  # same static batch and context as the fused engine: the forwards compare
        server = VerifyServer(target, tokenizer, max_batch_size=batch, max_len=config.max_len, k_buckets=(k,),
                              batch_window_ms=window_ms)  # fmt: skip
        address = f"127.0.0.1:{server.start()}"
    try:
        return _measure(target if server else None, draft, tokenizer, address, requests, config, sampled, k)
    finally:
        if server is not None:
            server.stop()


def _measure(target, draft, tokenizer, address, requests, config, sampled, k) -> dict:
    batch = config.max_batch_size
    fused = build_engine(config, tokenizer, target, {"draft": draft}) if target is not None else None
    verifier = RemoteVerifier(address)
    remote = build_engine(config, tokenizer, verifier, {"draft": draft})
    if fused is not None:
        fused.generate(requests[:1])  # warm-up
    remote.generate(requests[:1])
    verifier.verify_times.clear()
    row = {"batch": batch, "sampled": sampled, "k": k}
    if fused is not None:
        outs = fused.generate(requests)
        row["local_forward_ms"] = statistics.mean(o.stats["target_step_ms"] for o in outs)
    remote_outs = remote.generate(requests)
    if fused is not None:
        row["outputs_identical"] = [o.token_ids for o in outs] == [o.token_ids for o in remote_outs]
    rtt = [1e3 * r for r, _ in verifier.verify_times]
    side = [1e3 * t for _, t in verifier.verify_times]
    over = [r - t for r, t in zip(rtt, side)]
    row.update(
        calls=len(rtt),
        rpc_round_trip_ms=statistics.median(rtt),
        rpc_round_trip_p90_ms=sorted(rtt)[int(0.9 * (len(rtt) - 1))],
        target_side_ms=statistics.median(side),
        overhead_ms=statistics.median(over),
        q_bytes_per_call=(4 * k * remote.vocab_size * batch) if sampled else 0,
    )
    if fused is not None:
        row["rpc_over_local"] = row["rpc_round_trip_ms"] / row["local_forward_ms"]
    remote.close()
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=384)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64, help="per request; about new/(accepted+1) verify calls each")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--batch-window-ms", type=float, default=0.0, help="the target's batching window")
    ap.add_argument("--target-address", help="bench against a running `serve --role target` instead (no local column)")
    ap.add_argument("--out", default="runs/bench_grpc_verify.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    target, draft, tokenizer = tiny_pair(args.vocab, args.hidden, args.layers)
    rows = []
    for batch in args.batch:
        for sampled in (False, True):
            row = measure(target, draft, tokenizer, args.target_address, batch, sampled, args.k, args.new_tokens,
                          args.batch_window_ms)  # fmt: skip
            rows.append(row)
            print(
                f"batch {batch} {'sampled' if sampled else 'greedy '}: round trip {row['rpc_round_trip_ms']:.2f} ms, "
                f"target side {row['target_side_ms']:.2f} ms, overhead {row['overhead_ms']:.2f} ms"
                + (f", local forward {row['local_forward_ms']:.2f} ms" if "local_forward_ms" in row else ""),
                flush=True,
            )
    report = {
        "config": vars(args) | {"torch_threads": torch.get_num_threads(), "cpus": os.cpu_count()},
        "rows": rows,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
