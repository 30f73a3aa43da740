"""Checkpoints that are never half-written: build in a temporary sibling folder, then rename.

Two kinds live under the output folder:
- ``last/``: a resumable training state (model, optimizer, scheduler, RNG via accelerate's
  ``save_state``) plus ``progress.json`` (step, tokens seen, best acceptance, metric history).
- ``best/``: the student in Hugging Face format (safetensors, config, tokenizer) that
  transformers, vLLM and Choral's engine load directly; chosen by held-out acceptance.
- ``final/``: the same format, the student at the end of the run (written once, when it ends).
A folder only exists under its final name once it is complete, so ``--resume`` after a kill
loads the previous complete checkpoint, never a partial one.

Every checkpoint folder carries ``manifest.json``: the size and sha256 of each of its files,
written last. ``verify`` checks a folder against it and raises ``CheckpointError`` naming the first
missing, resized or changed file, so a damaged checkpoint (a flipped byte, a truncated optimizer
state, an emptied file) is refused in one line instead of loading or ending in a traceback that
names no file. ``last/`` keeps its predecessor as ``previous/`` (``output.keep_previous``), which
``--resume`` falls back to when ``last/`` is damaged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from serving.files import atomic_path, disk_full


@contextmanager
def atomic_dir(final: Path, tmp: Path | None = None) -> Iterator[Path]:
    """Yield a temporary folder (``tmp``, or a fresh one beside ``final``); on success it
    replaces ``final`` by renames, on failure it is deleted."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if tmp is None:
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        yield tmp
        old = None
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):
            raise disk_full(final, e) from e
        raise


def write_json_atomic(path: Path, data: dict) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1))


def recover(final: Path) -> None:
    """A kill between the two renames of ``atomic_dir`` leaves only ``.NAME.old``: restore it."""
    final = Path(final)
    old = final.with_name(f".{final.name}.old")
    if not final.exists() and old.exists():
        os.replace(old, final)


MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used, naming the file and the fix."""


def sha256_file(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _files(folder: Path) -> list[Path]:
    """The checkpoint's files: hidden ones (a desktop's .DS_Store, NFS's .nfsXXXX) are not its own."""
    return sorted(p for p in folder.rglob("*")
                  if p.is_file() and p.name != MANIFEST and not any(part.startswith(".") for part in p.relative_to(folder).parts))  # fmt: skip


def write_manifest(folder: Path) -> None:
    """``folder/manifest.json``: every file's size and sha256, written last and atomically."""
    folder = Path(folder)
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in _files(folder)}
    write_json_atomic(folder / MANIFEST, {"format": 1, "files": files})


def verify(folder: Path, *, unchecked: bool = False) -> bool:
    """Check ``folder`` against its manifest. True when it matches; ``CheckpointError`` naming the
    first file that is missing, of another size or another content, or a manifest that does not
    parse. A folder without a manifest (deleted, or written before checkpoints carried one) cannot
    be checked: refused, unless ``unchecked`` (``output.resume_unchecked``), then False."""
    folder = Path(folder)
    path = folder / MANIFEST
    if not path.is_file():
        if unchecked:
            return False
        raise CheckpointError(f"{folder} has no {MANIFEST}, so nothing says its files are the ones written (a flipped "
                              "byte would load): resume from another checkpoint, or pass output.resume_unchecked=true "
                              "to resume it unchecked")  # fmt: skip
    try:
        listed = json.loads(path.read_text())["files"]
        if not isinstance(listed, dict) or not all(
                isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str) for e in listed.values()):
            raise TypeError("its entries are not {bytes, sha256} records")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} is damaged ({type(e).__name__}: {e}); the checkpoint in {folder} cannot be "
                              "checked: delete it to start over, or resume from another") from None  # fmt: skip
    for name, entry in listed.items():
        file = folder / name
        if not file.is_file():
            why = "is missing"
        elif file.stat().st_size != entry.get("bytes"):
            why = f"has {file.stat().st_size:,} bytes, the manifest says {entry.get('bytes'):,}"
        elif sha256_file(file) != entry.get("sha256"):
            why = "does not match its sha256 in the manifest (the file changed after it was written)"
        else:
            continue
        raise CheckpointError(f"{file} {why}: the checkpoint in {folder} is damaged; delete it (or restore the file) "
                              "and resume from an earlier one, or start over")  # fmt: skip
    extra = [str(p.relative_to(folder)) for p in _files(folder) if str(p.relative_to(folder)) not in listed]
    if extra:
        raise CheckpointError(f"{folder / extra[0]} is not in the checkpoint's manifest: the folder was changed after it "
                              "was written; remove the file or resume from another checkpoint")  # fmt: skip
    return True


def keep_previous(final: Path) -> None:
    """Before ``final`` is replaced: move it to ``previous/`` beside it (replacing an older one),
    if it verifies; a damaged one is deleted instead, so that a good ``previous/`` stays."""
    final = Path(final)
    if not final.exists():
        return
    try:
        verify(final, unchecked=True)  # one of ours always has a manifest; an older one is kept as it was
    except CheckpointError:
        shutil.rmtree(final, ignore_errors=True)
        return
    previous = final.with_name("previous")
    shutil.rmtree(previous, ignore_errors=True)
    os.replace(final, previous)


def resumable(run_dir: Path, log=print, *, unchecked: bool = False) -> Path | None:
    """The checkpoint folder ``--resume`` loads: ``last/`` when it verifies, else ``previous/``
    when that does (``log`` says why last/ was passed over), else None when neither exists. A
    damaged checkpoint, or one without a manifest, with no good one to fall back to raises
    ``CheckpointError``; ``unchecked`` resumes one without a manifest, and ``log`` says so."""
    run_dir = Path(run_dir)
    recover(run_dir / "last")
    damaged = None
    for name in ("last", "previous"):
        folder = run_dir / name
        if not (folder / "progress.json").is_file() and not (folder / MANIFEST).is_file():
            continue
        try:
            checked = verify(folder, unchecked=unchecked)
        except CheckpointError as e:
            damaged = damaged or e
            continue
        if not checked:
            log(f"{folder} has no {MANIFEST}: resuming it UNCHECKED (output.resume_unchecked=true)")
        if damaged is not None:
            log(f"{damaged}; resuming from {folder} instead")
        return folder
    if damaged is not None:
        raise damaged
    return None


def read_progress_file(folder: Path) -> dict:
    """``folder/progress.json``, or ``CheckpointError`` naming it."""
    path = Path(folder) / "progress.json"
    try:
        progress = json.loads(path.read_text())
        if not isinstance(progress, dict) or "step" not in progress:
            raise ValueError("no step in it")
        return progress
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path} cannot be read ({type(e).__name__}: {e}); delete the checkpoint in {folder} "
                              "and resume from an earlier one, or start over") from None  # fmt: skip
