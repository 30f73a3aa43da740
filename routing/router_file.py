"""router.pt: the one file a trained router lives in, and the only code that reads or writes it.

    write_router_file("runs/router/router.pt", router.to_dict())
    data = read_router_file("runs/router/router.pt")  # checked: format, version, every key

The file is a header line ``CHORAL-ROUTER sha256=<hex>`` followed by ``torch.save``'s bytes of
``Router.to_dict``. The header's sha256 covers every byte after it: ``torch.load`` checks no zip
CRC and ignores some bytes, so without it a flipped byte could load silently. Files written before
the header (a plain ``torch.save`` zip) still load, checked by the zip's own CRCs.

Every role reads the file here, before loading any model (``serve --role target`` needs only
``target_ref``), so a damaged file is refused with its name and what to do, never a traceback.
"""

from __future__ import annotations

import hashlib
import io
import os
import zipfile
from pathlib import Path

import torch

from serving.files import atomic_path

FORMAT = "choral-router"
FORMAT_VERSION = 1
MAGIC = b"CHORAL-ROUTER sha256="
KEYS = (
    "format", "format_version", "draft_names", "draft_refs", "target_ref", "objective", "embedder",
    "cheap_features", "feature_dim", "mean", "std", "mlp", "state_dict", "costs", "k_buckets", "info",
)  # fmt: skip
_RETRAIN = "re-run train-router (or copy the file again) to write it whole"


class RouterError(ValueError):
    """A router file that cannot be used: missing, truncated, another format, or inconsistent."""


def write_router_file(path: str | Path, data: dict) -> None:
    """Write ``data`` (``Router.to_dict``) as router.pt atomically: a temporary file, synced, then
    renamed over ``path``, so a reader never sees half a file."""
    buffer = io.BytesIO()
    torch.save(data, buffer)
    payload = buffer.getvalue()
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        f.write(MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n")
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


def read_router_file(path: str | Path) -> dict:
    """router.pt's checked contents (``Router.to_dict``'s dict), without loading its embedder.
    Refuses, naming the file, one that is missing, empty, truncated, altered anywhere (the
    header's sha256), of another format or version, or without every key."""
    path = Path(path)
    if not path.is_file():
        raise RouterError(f"router file {path} does not exist; build one with `train-router --config ...`")
    payload = _checked_payload(path, path.read_bytes())
    try:
        data = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:
        raise RouterError(f"{path} is not a readable router file (truncated or corrupt?): "
                          f"{type(e).__name__}: {e}; {_RETRAIN}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise RouterError(f"{path} is not a Choral router file (no format={FORMAT!r} marker)")
    if data.get("format_version") != FORMAT_VERSION:
        raise RouterError(
            f"{path} has router format version {data.get('format_version')!r}; this Choral reads version "
            f"{FORMAT_VERSION}: retrain it with this version's train-router"
        )
    missing = [k for k in KEYS if k not in data]
    if missing:
        raise RouterError(f"{path} lacks the keys {missing}: the file is incomplete, retrain it")
    return data


def _checked_payload(path: Path, raw: bytes) -> bytes:
    """The ``torch.save`` bytes of a router file whose checksum holds: the header's sha256, or for
    a file written before the header, its zip members' CRCs."""
    if raw.startswith(MAGIC):
        header, _, payload = raw.partition(b"\n")
        if hashlib.sha256(payload).hexdigest().encode() != header[len(MAGIC) :]:
            raise RouterError(f"{path} fails its sha256 check: the file was altered or cut short; {_RETRAIN}")
        return payload
    if raw.startswith(b"PK\x03\x04"):  # written before the header existed: the zip's own CRCs only
        try:
            bad = zipfile.ZipFile(io.BytesIO(raw)).testzip()
        except (zipfile.BadZipFile, OSError, ValueError) as e:
            raise RouterError(f"{path} is not a readable router file (truncated or corrupt?): {e}; {_RETRAIN}") from None
        if bad is not None:
            raise RouterError(f"{path} fails the CRC check of its member {bad!r}: the file is corrupt; {_RETRAIN}")
        return raw
    what = "empty" if not raw else "not a Choral router file (no router header)"
    raise RouterError(f"{path} is {what}; pass the router.pt that train-router wrote")
