"""Checkpoints that are never half-written: build in a temporary sibling folder, then rename.

Two kinds live under the output folder:
- ``last/``: a resumable training state (model, optimizer, scheduler, RNG via accelerate's
  ``save_state``) plus ``progress.json`` (step, tokens seen, best acceptance, metric history).
- ``best/``: the student in Hugging Face format (safetensors, config, tokenizer) that
  transformers, vLLM and Choral's engine load directly; chosen by held-out acceptance.
- ``final/``: the same format, the student at the end of the run (written once, when it ends).
A folder only exists under its final name once it is complete, so ``--resume`` after a kill
loads the previous complete checkpoint, never a partial one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


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
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; once written, it replaces ``path`` in one rename."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    yield tmp
    os.replace(tmp, path)


def write_json_atomic(path: Path, data: dict) -> None:
    with atomic_file(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1))


def recover(final: Path) -> None:
    """A kill between the two renames of ``atomic_dir`` leaves only ``.NAME.old``: restore it."""
    final = Path(final)
    old = final.with_name(f".{final.name}.old")
    if not final.exists() and old.exists():
        os.replace(old, final)


def read_progress(run_dir: Path) -> dict | None:
    last = Path(run_dir) / "last"
    recover(last)
    path = last / "progress.json"
    return json.loads(path.read_text()) if path.exists() else None
