"""A disk cache of the CPU kernels' low-bit layers, so that a model folder is converted once.

Putting the bundled 1.5B target in 4-bit groups (``target_weights=q4``: recovering every Q4_K
group from the dequantized fp32 weights) took about 60 s on the 2-core VM, and int8 conversion
5-15 s a model, in every command that loaded them: serve, collect-router-data, spec-bench.
``prepare_for_cpu`` now stores each converted Linear's buffers under ``CHORAL_HOME/prepared/`` the
first time and loads them afterwards (a few seconds; the converted 1.5B is about 1.2 GB).

A cached entry stands for exactly what ``load_model`` read from a folder. ``mark_loaded`` records
the folder's files (names, sizes, modification times) and, for each parameter, its storage and
version counter. A model changed since then has no entry and is converted as before: trained
(train-draft's student; an optimizer step bumps the version), merged, or given new tensors. The
key also covers the weights kind and this package's conversion code (``cpu_kernels.py``), so a
change to either makes a new entry. Entries are written to a temporary file and renamed, so an
interrupted write leaves no half entry; an unreadable one is converted again, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import torch
from torch import nn

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the stored layout of a layer changes in a way the code digest does not show
_WEIGHT_FILES = (".safetensors", ".bin")
_ATTR = "_choral_loaded"


def mark_loaded(model: nn.Module, folder: str | Path) -> None:
    """Record that ``model`` holds exactly the weights of ``folder`` as of now."""
    folder = Path(folder).resolve()
    files = sorted(p for p in folder.iterdir() if p.suffix in _WEIGHT_FILES or p.name == "config.json")
    stamp = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    model.__dict__[_ATTR] = (str(folder), stamp, _param_state(model))


def _param_state(model: nn.Module) -> dict[str, tuple[int, int]]:
    return {name: (p.data_ptr(), p._version) for name, p in model.named_parameters(remove_duplicate=False)}


def entry(model: nn.Module, weights: str) -> Path | None:
    """Where ``model``'s layers in ``weights`` are (or would be) cached, or None when the model is
    not as it was loaded from a folder (or never was)."""
    info = model.__dict__.get(_ATTR)
    if info is None:
        return None
    folder, stamp, params = info
    if _param_state(model) != params:
        return None
    from serving.engine import cpu_kernels
    from serving.engine.bundled import choral_home

    code = hashlib.sha256(Path(cpu_kernels.__file__).read_bytes()).hexdigest()
    key = hashlib.sha256(json.dumps([FORMAT, weights, stamp, code, torch.__version__]).encode()).hexdigest()[:16]
    where = hashlib.sha256(folder.encode()).hexdigest()[:8]
    return choral_home() / "prepared" / f"{Path(folder).name}-{where}-{weights}-{key}.safetensors"


def load(path: Path) -> dict[str, nn.Module] | None:
    """The cached layers at ``path`` by their module names, or None (no entry, or unreadable)."""
    if not path.exists():
        return None
    from safetensors import safe_open
    from safetensors.torch import load_file

    from serving.engine.cpu_kernels import Int8Linear, Q4Linear

    try:
        with safe_open(str(path), "pt") as f:
            layers = json.loads(f.metadata()["layers"])
        tensors = load_file(str(path))
        built: dict[str, nn.Module] = {}
        for name, (kind, in_features, out_features) in layers.items():
            bias = tensors.get(f"{name}.bias")
            if kind == "Q4Linear":
                built[name] = Q4Linear.from_buffers(in_features, tensors[f"{name}.qweight"], tensors[f"{name}.step"],
                                                    tensors[f"{name}.minimum"], bias)  # fmt: skip
            elif kind == "Int8Linear":
                built[name] = Int8Linear.from_buffers(in_features, tensors[f"{name}.qweight"], tensors[f"{name}.scale"], bias)
            else:
                raise ValueError(f"unknown layer kind {kind!r}")
            if built[name].out_features != out_features:
                raise ValueError(f"{name}: {built[name].out_features} rows stored, {out_features} expected")
    except Exception as exc:  # noqa: BLE001 - a damaged entry is converted again, not fatal
        log.warning("choral: the prepared-weights cache %s could not be read (%s); converting again", path, exc)
        return None
    return built


def save(path: Path, layers: dict[str, nn.Module]) -> None:
    """Store ``layers`` (module name -> Q4Linear / Int8Linear) at ``path``, atomically, and remove
    older entries of the same folder and weights."""
    from safetensors.torch import save_file

    tensors, meta = {}, {}
    for name, mod in layers.items():
        meta[name] = (type(mod).__name__, mod.in_features, mod.out_features)
        for b, t in mod.named_buffers(recurse=False):
            if b != "row_sums":  # recomputed on load
                tensors[f"{name}.{b}"] = t.contiguous()
        if mod.bias is not None:
            tensors[f"{name}.bias"] = mod.bias.detach().contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"layers": json.dumps(meta)})
        os.replace(tmp, path)
    except OSError as exc:  # a full or read-only disk: the model still runs, only unconverted next time
        log.warning("choral: could not write the prepared-weights cache %s (%s)", path, exc)
        tmp.unlink(missing_ok=True)
        return
    prefix = path.name.rsplit("-", 1)[0] + "-"
    for old in path.parent.glob(f"{prefix}*.safetensors"):
        if old != path:
            old.unlink(missing_ok=True)
