"""A disk cache of the CPU kernels' low-bit layers, so that a model folder is converted once.

Putting the bundled 1.5B target in 4-bit groups (``target_weights=q4``: recovering every Q4_K
group from the dequantized fp32 weights) takes about a minute on a small CPU, and int8 conversion
seconds a model, in every command that loads them: serve, collect-router-data, spec-bench (the
measurements: docs/architecture.md, "CPU kernels").
``prepare_for_cpu`` now stores each converted Linear's buffers under ``$CHORAL_HOME/prepared/``
(or ``$CHORAL_PREPARED_DIR``) the first time and loads them afterwards.

An entry is found by the **content** of the layers it replaces: an xxh3 hash of every fp32 Linear's
name, shape and bytes (about a second for the 1.5B target's 6 GB, against a minute to convert), with
the weights kind, the conversion code (this file, ``cpu_kernels.py`` and the kernels'
``rowdot.cpp``, as imported) and the torch version. So a model whose weights changed in any way,
however they were changed, misses and is converted from its own weights. Only models that
``load_model`` read from a folder and that are still as loaded (``mark_loaded``: each parameter's
storage and version) are cached at all, so a draft that train-draft is training does not write an
entry at every evaluation.

Entries are written to a temporary file, fsynced and renamed, so an interrupted write leaves no
half entry; an unreadable one is converted again, with a warning; a disk that cannot take the
entry costs only the conversion next time. Each folder keeps its ``KEEP`` most recently used
entries per weights kind.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from serving.engine.bundled import choral_home

log = logging.getLogger(__name__)

FORMAT = 5  # bump when the stored layout of a layer changes (3: Q4Linear in blocks of 16 groups; 4: row_sums stored;
# 5: Q4Linear in panels of 16 outputs)
KEEP = 3  # entries kept per (folder, weights kind): two installs sharing a home do not evict each other
_ATTR = "_choral_loaded"


def _code_digest() -> str | None:
    """The conversion code as imported (not as it may be on disk when prepare_for_cpu runs), and the
    kernel source whose weight layout it writes; None where the sources are not there to read
    (then nothing is cached)."""
    names = ("cpu_kernels.py", "weights_cache.py", "rowdot.cpp")
    try:
        return hashlib.sha256(b"".join(Path(__file__).with_name(n).read_bytes() for n in names)).hexdigest()
    except OSError:
        return None


_CODE = _code_digest()


def prepared_dir() -> Path:
    return Path(os.environ.get("CHORAL_PREPARED_DIR") or choral_home() / "prepared").expanduser()


def mark_loaded(model: nn.Module, folder: str | Path) -> None:
    """Record that ``model`` was just read from ``folder``: its conversion may be cached."""
    model.__dict__[_ATTR] = (str(Path(folder).resolve()), _param_state(model))


def _param_state(model: nn.Module) -> dict[str, tuple[int, int]]:
    return {name: (p.data_ptr(), p._version) for name, p in model.named_parameters(remove_duplicate=False)}


def entry(model: nn.Module, weights: str, layers: list[tuple[str, nn.Linear]]) -> Path | None:
    """Where the conversion of ``layers`` (module name, fp32 Linear) to ``weights`` is (or would be)
    cached; None for a model not read by ``load_model`` or changed since (never cached)."""
    info = model.__dict__.get(_ATTR)
    if info is None or _CODE is None or _param_state(model) != info[1]:
        return None
    try:
        import xxhash
    except ImportError:  # an environment installed before it was a dependency: convert, do not cache
        log.warning("choral: xxhash is not installed (pip install xxhash); int8/q4 conversions are not cached")
        return None
    h = xxhash.xxh3_128()
    for name, lin in sorted(layers, key=lambda x: x[0]):
        for part in ("weight", "bias"):
            t = getattr(lin, part)
            if t is None:
                continue
            t = t.detach().contiguous()
            h.update(f"{name}.{part}:{tuple(t.shape)}:{t.dtype};".encode())
            h.update(t.view(torch.uint8).numpy().data if t.numel() else b"")
    key = hashlib.sha256(json.dumps([FORMAT, weights, h.hexdigest(), _CODE, torch.__version__]).encode()).hexdigest()[:16]
    folder = hashlib.sha256(info[0].encode()).hexdigest()[:8]
    return prepared_dir() / f"{Path(info[0]).name}-{folder}-{weights}-{key}.safetensors"


def load(path: Path, build: Callable[[str, str, int, int, dict[str, torch.Tensor]], nn.Module]) -> dict[str, nn.Module] | None:
    """The cached layers at ``path`` by their module names, or None (no entry, or unreadable).
    ``build(name, kind, in_features, out_features, tensors)`` makes a layer of its stored kind from
    the file's tensors (the kernels' module, ``serving.engine.cpu_kernels``, knows the kinds)."""
    if not path.exists():
        return None
    from safetensors import safe_open
    from safetensors.torch import load_file

    try:
        with safe_open(str(path), "pt") as f:
            layers = json.loads(f.metadata()["layers"])
        tensors = load_file(str(path))
        built: dict[str, nn.Module] = {}
        for name, (kind, in_features, out_features) in layers.items():
            built[name] = build(name, kind, in_features, out_features, tensors)
            if built[name].out_features != out_features:
                raise ValueError(f"{name}: {built[name].out_features} rows stored, {out_features} expected")
    except Exception as exc:  # noqa: BLE001 - a damaged entry is converted again, not fatal
        log.warning("choral: the prepared-weights cache %s could not be read (%s); converting again", path, exc)
        return None
    try:
        os.utime(path)  # most recently used: pruning keeps it
    except OSError:  # a read-only cache, or another user's entry: still a good entry
        pass
    return built


def save(path: Path, layers: dict[str, nn.Module]) -> None:
    """Store ``layers`` (module name -> Q4Linear / Int8Linear) at ``path``, atomically; keep the
    folder's ``KEEP`` most recently used entries of this weights kind. Never raises: a cache that
    cannot be written only means converting again next time."""
    from safetensors.torch import save_file

    tensors, meta = {}, {}
    for name, mod in layers.items():
        meta[name] = (type(mod).__name__, mod.in_features, mod.out_features)
        for b, t in mod.named_buffers(recurse=False):
            tensors[f"{name}.{b}"] = t.contiguous()
        if mod.bias is not None:
            tensors[f"{name}.bias"] = mod.bias.detach().contiguous()
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_temporaries(path.parent)
        save_file(tensors, str(tmp), metadata={"layers": json.dumps(meta)})
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except Exception as exc:  # noqa: BLE001 - a full or read-only disk: the model still runs
        log.warning("choral: could not write the prepared-weights cache %s (%s)", path, exc)
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return
    prefix = path.name.rsplit("-", 1)[0] + "-"
    try:  # another process may be pruning too
        same = [p for p in path.parent.iterdir() if p.name.startswith(prefix) and p.suffix == ".safetensors"]
        for old in sorted(same, key=lambda p: p.stat().st_mtime, reverse=True)[KEEP:]:
            old.unlink(missing_ok=True)
    except OSError:
        pass


def _remove_stale_temporaries(folder: Path, older_than_s: float = 3600.0) -> None:
    """Temporary files a killed writer left (ours, ``.*.tmp``, and safetensors' own ``.tmp*``)."""
    now = time.time()
    for p in folder.iterdir():
        if p.name.startswith(".") and (p.name.endswith(".tmp") or p.name.startswith(".tmp")):
            try:
                if now - p.stat().st_mtime > older_than_s:
                    p.unlink()
            except OSError:
                pass
