"""The collection loop: run every prompt through the real engine with every draft (and the
target alone, draft "none") and append one row per (prompt, draft, mode, repeat).

One ``SpeculativeEngine`` holds the target and every drafter; each request names its drafter.
Per prompt chunk the target alone runs first, so every draft row can carry its speedup (its
tokens/s over the target alone's on the same prompt, mode and repeat) when it is written. The
target's prefill of a prompt is computed by the first of its rows and, at batch size 1, reused by
the others, which are charged its measured time (``EngineSettings.reuse_prefill``; the draft
model's own prefill is computed and timed in every row that uses it). Rows already in the output
file are skipped, so rerunning resumes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from routing.config import CollectConfig
from routing.router import NONE
from routing.rows import RowStore
from serving.engine import Request, SpeculativeEngine
from serving.engine.devices import resolve_device
from serving.engine.engine_settings import EngineSettings, is_model_ref
from serving.engine.loader import load_engine
from serving.engine.models import load_tokenizer
from serving.engine.sampling import SamplingParams
from serving.prompts import Prompt, encode_prompt, load_prompts, read_prompt_file
from serving.workload import FAMILIES, load_workload


def parse_shard(text: str) -> tuple[int, int]:
    """``"i/n"`` (0 <= i < n) -> (i, n)."""
    try:
        i, n = (int(part) for part in text.split("/"))
    except ValueError:
        raise ValueError(f"--shard {text!r} must look like i/n, e.g. 0/2 and 1/2 for two processes") from None
    if not 0 <= i < n:
        raise ValueError(f"--shard {text!r}: need 0 <= i < n (shards are numbered from 0)")
    return i, n


def env_shard() -> tuple[int, int] | None:
    """The shard of this process under ``accelerate launch`` / torchrun (RANK, WORLD_SIZE)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return (int(os.environ.get("RANK", "0")), world) if world > 1 else None


def shard_output(output: str | Path, shard: tuple[int, int] | None) -> Path:
    """rows.jsonl -> rows.shard0of2.jsonl for shard 0/2 (shards never share a file)."""
    path = Path(output)
    return path if shard is None else path.with_name(f"{path.stem}.shard{shard[0]}of{shard[1]}{path.suffix}")


def load_sources(cfg: CollectConfig, splits: dict[str, str] | None = None) -> list[Prompt]:
    """All prompts of the config's sources, in order; prompt ids must be unique (they key rows).
    ``splits``, if given, receives the workload split of each prompt taken from a ``family``."""
    prompts: list[Prompt] = []
    for src in cfg.sources:
        if src.domain is not None:
            got = load_prompts(src.domain, src.n, offset=src.offset, seed=src.seed)
        elif src.family is not None:
            families = list(FAMILIES) if src.family == "all" else [src.family]
            got = load_workload(src.split, src.n, families=families, offset=src.offset, seed=src.seed)
            if splits is not None:
                splits.update((p.id, src.split) for p in got)
        else:
            if not Path(src.file).is_file():
                raise FileNotFoundError(f"prompt file {src.file} does not exist (sources[].file)")
            got = read_prompt_file(src.file)[src.offset :]
            got = got[: src.n] if src.n is not None else got
        if not got:
            raise ValueError(f"source {src} gave no prompts")
        prompts += got
    seen: set[str] = set()
    for p in prompts:
        if p.id in seen:
            raise ValueError(f"prompt id {p.id!r} appears twice in the sources; ids key the rows, so make them unique")
        seen.add(p.id)
    return prompts


def request_seed(base: int, prompt_id: str, repeat: int) -> int:
    """A sampled run's seed: stable across processes and shards, shared by all drafts."""
    return int.from_bytes(hashlib.sha256(f"{base}/{prompt_id}/{repeat}".encode()).digest()[:4], "little")


def sampling(cfg: CollectConfig, mode: str, prompt_id: str, repeat: int) -> SamplingParams:
    if mode == "greedy":
        return SamplingParams(temperature=0.0)
    d = cfg.decode
    return SamplingParams(d.temperature, d.top_k, d.top_p, seed=request_seed(d.seed, prompt_id, repeat))


def make_row(cfg: CollectConfig, prompt: Prompt, n_prompt: int, draft: str, mode: str, repeat: int, out, speedup,
             split: str | None = None) -> dict:  # fmt: skip
    s = out.stats
    return {
        "prompt_id": prompt.id,
        "domain": prompt.domain,
        "split": split,  # the workload's fixed split, for prompts of a `family` source
        "text": prompt.text,
        "use_chat_template": prompt.use_chat_template,
        "prompt_tokens": n_prompt,
        "draft": draft,
        "draft_ref": None if draft == NONE else cfg.drafts[draft],
        "target": cfg.target,
        "target_weights": cfg.engine.target_weights,  # the precision these measurements describe
        # and the draft model's (auto resolved); ngram and suffix have none
        "draft_weights": cfg.engine.drafts_weights() if is_model_ref(cfg.drafts.get(draft)) else None,
        "mode": mode,
        "repeat": repeat,
        "k": 0 if draft == NONE else cfg.engine.k,
        "mean_k": s["mean_k"],  # what each verification drafted on average: the answer's end caps K
        "batch_size": cfg.engine.max_batch_size,
        "new_tokens": s["new_tokens"],
        "target_calls": s["target_calls"],
        "acceptance_rate": s["acceptance_rate"],
        "mean_accepted_length": s["mean_accepted_length"],
        "per_position_acceptance": s["per_position_acceptance"],
        # Identifies the output (lossless decoding: greedy outputs agree across drafts).
        "output_sha": hashlib.sha256(str(out.token_ids).encode()).hexdigest()[:16],
        "finish_reason": out.finish_reason,
        "draft_step_ms": s["draft_step_ms"],
        "target_step_ms": s["target_step_ms"],
        "draft_target_cost_ratio": s["draft_target_cost_ratio"],
        "prefill_ms": 1e3 * s["prefill_time_s"],
        "prefill_reused": s.get("prefill_reused", False),  # the target's prefill was this prompt's earlier one, its time charged
        "total_ms": 1e3 * s["total_time_s"],
        "tokens_per_second": s["tokens_per_second"],
        "speedup": speedup,
    }


def collect(
    cfg: CollectConfig,
    *,
    shard: tuple[int, int] | None = None,
    on_row: Callable[[dict], None] | None = None,
) -> Path:
    """Collect the rows of ``cfg`` (of shard ``(i, n)``: prompts i, i+n, ...) into the output
    file, skipping rows already there. ``on_row`` is called after each row is durably written.
    Returns the file's path."""
    shard = shard or env_shard()
    # The precisions that run, not "auto": each row records them.
    cfg = dataclasses.replace(cfg, engine=cfg.engine.resolved(cfg.target))
    splits: dict[str, str] = {}
    prompts = load_sources(cfg, splits)
    if shard is not None:
        prompts = prompts[shard[0] :: shard[1]]
    store = RowStore(shard_output(cfg.output, shard))
    names = ([NONE] if cfg.baseline else []) + list(cfg.drafts)
    modes, repeats = cfg.decode.modes, range(cfg.decode.repeats)
    todo = [
        (p, m, r, n) for p in prompts for m in modes for r in repeats for n in names
        if (p.id, n, m, r) not in store
    ]  # fmt: skip
    total = len(prompts) * len(modes) * len(repeats) * len(names)
    print(f"collect-router-data: {len(prompts)} prompts x {len(names)} drafts x {len(modes)} modes x "
          f"{len(repeats)} repeats = {total} rows; {total - len(todo)} already in {store.path}")  # fmt: skip
    if not todo:
        return store.path

    tokenizer = load_tokenizer(cfg.target)
    ids = {p.id: encode_prompt(tokenizer, p) for p in prompts}
    max_len = cfg.engine.max_len or max(len(i) for i in ids.values()) + cfg.decode.max_new_tokens + cfg.engine.k + 1
    # Each prompt runs once per drafter in the same rows: its target prefill is computed once and
    # charged to every row at its measured time (EngineSettings.reuse_prefill; null here means on at
    # batch size 1). In a larger batch a request's clock also runs through the prefills admitted
    # after it in the same step, which a reuse would shorten for some drafters and not others.
    reuse = cfg.engine.max_batch_size == 1 if cfg.engine.reuse_prefill is None else cfg.engine.reuse_prefill
    engines = _build_engines(cfg, dataclasses.replace(cfg.engine, max_len=max_len, reuse_prefill=reuse))

    B = cfg.engine.max_batch_size
    with tqdm(total=total, initial=total - len(todo), desc="collect-router-data", unit="row") as bar:
        for start in range(0, len(prompts), B):
            chunk = prompts[start : start + B]
            for mode in modes:
                for repeat in repeats:
                    for name in names:  # NONE first: draft rows need its tokens/s
                        pending = [p for p in chunk if (p.id, name, mode, repeat) not in store]
                        if not pending:
                            continue
                        reqs = [
                            Request(ids[p.id], params=sampling(cfg, mode, p.id, repeat), max_new_tokens=cfg.decode.max_new_tokens,
                                    drafter=name)
                            for p in pending
                        ]  # fmt: skip
                        outs = engines[name].generate(reqs)
                        for p, out in zip(pending, outs):
                            speedup = _speedup(store, p.id, name, mode, repeat, out.stats["tokens_per_second"])
                            row = make_row(cfg, p, len(ids[p.id]), name, mode, repeat, out, speedup, splits.get(p.id))
                            store.append(row)
                            bar.update(1)
                            if on_row is not None:
                                on_row(row)
    return store.path


def _speedup(store: RowStore, prompt_id: str, name: str, mode: str, repeat: int, tps: float) -> float | None:
    if name == NONE:
        return 1.0
    base = store.get((prompt_id, NONE, mode, repeat))
    if base is None or not base["tokens_per_second"]:
        return None  # baseline: false
    return tps / base["tokens_per_second"]


def _build_engines(cfg: CollectConfig, settings: EngineSettings) -> dict[str, SpeculativeEngine]:
    """Every drafter name (and NONE) mapped to the one engine that holds them all (one target, one
    KV cache); each drafter is warmed up once so no row pays first-call costs. A row's requests
    name their drafter, and one drafter's requests run at a time, so each row's speed is its own."""
    if resolve_device(settings.device).type == "cuda" and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))  # one GPU per process under accelerate launch
    drafts = dict(cfg.drafts) | ({NONE: None} if cfg.baseline else {})
    # Each drafter is measured at its K: a goodput cap would lower K by how many of its rows share a
    # step, and the router would learn the collection's batch instead of the drafter.
    engine = load_engine(dataclasses.replace(settings, step_k="rows"), cfg.target, drafts).engine
    warm = engine.tokenizer.encode("Hello world", add_special_tokens=False) or [0]
    for name in drafts:
        engine.generate([Request(warm, max_new_tokens=4, drafter=name)] * settings.max_batch_size)
    return {name: engine for name in drafts}
