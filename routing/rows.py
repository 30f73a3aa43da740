"""The collected-rows file: append-only JSONL, one measurement a line, keyed by
``(prompt_id, draft, mode, repeat)``.

Each row is written with a single ``write`` of one line, then flushed and fsynced, so a crash
leaves at most one partial last line; opening the file again cuts that line off (it is redone),
which is what makes an interrupted collection resume without losing or duplicating a row.
Shards are separate files that ``merge`` joins (deduplicated by key, sorted by key).

Each line carries ``crc32``, the checksum of the rest of its row (its JSON with sorted keys): a
byte flipped on disk (a digit of a measured speed, say) is refused with the file and line named,
instead of training a router on it. Rows written before the field existed are read as they are,
but a file is checked as a whole: one whose rows carry checksums refuses a row without one, and a
key one byte from ``crc32`` is refused as a damaged checksum, not read as an older row.
"""

from __future__ import annotations

import errno
import json
import os
import zlib
from pathlib import Path
from typing import Iterable

from serving.files import atomic_path, disk_full

KEY_FIELDS = ("prompt_id", "draft", "mode", "repeat")
# Fields that come from clocks, or from how a run was cut (a resumed prompt's first row prefills
# again): they differ between runs of the same work, everything else must not.
TIMING_FIELDS = (
    "draft_step_ms", "target_step_ms", "draft_target_cost_ratio", "tokens_per_second", "speedup",
    "prefill_ms", "total_ms", "prefill_reused",
)  # fmt: skip

Key = tuple[str, str, str, int]
CHECKSUM = "crc32"  # the field holding a line's checksum
_TAIL = f', "{CHECKSUM}": "????????"}}'.encode()  # how every line ends ("?": a hex digit of the checksum)


def encode_row(row: dict) -> bytes:
    """One line of the file: the row's JSON (sorted keys) with its checksum."""
    if CHECKSUM in row:
        raise ValueError(f"a collected row may not hold a field named {CHECKSUM!r}: the file's checksum goes there")
    # Through JSON once first: the checksum must be of what a reader parses back (int dict keys become strings).
    body = json.dumps(json.loads(json.dumps(row)), sort_keys=True)
    return (body[:-1] + f', "{CHECKSUM}": "{zlib.crc32(body.encode()):08x}"}}\n').encode() if body != "{}" else b"{}\n"


def decode_row(line: bytes) -> dict:
    """The row of one line, its checksum checked (and dropped); ``ValueError`` if it does not match."""
    return _decode(line)[0]


def _decode(line: bytes) -> tuple[dict, bool]:
    """(the row, whether its line carried a checksum)."""
    row = json.loads(line)
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    stored = row.pop(CHECKSUM, None)
    # A byte changed inside the checksum's own field ("crc32" -> "crc3r", or "\\rc32": an escape)
    # would read as a row written before checksums, unchecked: a line that ends one byte away from
    # how ``encode_row`` ends every line is that damage.
    tail = line.rstrip(b"\r\n")[-len(_TAIL) :]
    if stored is None and len(tail) == len(_TAIL) and sum(t != b"?"[0] and a != t for a, t in zip(tail, _TAIL)) <= 1:
        raise ValueError(f"its {CHECKSUM} field is damaged ({tail.decode(errors='replace')!r})")
    if stored is not None:
        body = json.dumps(row, sort_keys=True)
        if f"{zlib.crc32(body.encode()):08x}" != stored:
            raise ValueError(f"its {CHECKSUM} {stored} does not match its content")
    return row, stored is not None


def row_key(row: dict) -> Key:
    return (str(row["prompt_id"]), str(row["draft"]), str(row["mode"]), int(row["repeat"]))


def read_rows(path: str | Path, *, repair: bool = False) -> list[dict]:
    """Rows of a JSONL file. A partial last line (a crash mid-write) is skipped, and with
    ``repair`` cut from the file; a bad line anywhere else is an error naming it."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1  # everything after the last newline is an unfinished write
    rows, checked = [], None  # checked: whether the file's rows carry checksums (all must, or none)
    for lineno, line in enumerate(data[:end].splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row, has = _decode(line)
            if checked is not None and has != checked:
                raise ValueError(f"{'it has' if has else 'it has no'} {CHECKSUM} where the file's first row "
                                 f"{'has none' if has else 'has one'}: the file's rows are checked as a whole")  # fmt: skip
            checked = has
            row_key(row)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"{path}:{lineno} is not a collected row ({e}); the file is damaged in the middle: "
                "delete that line (or the file) and rerun"
            ) from None
        rows.append(row)
    if repair and end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
    return rows


class RowStore:
    """The rows of one file plus appending to it durably."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.rows: dict[Key, dict] = {}
        for row in read_rows(self.path, repair=True):
            self.rows.setdefault(row_key(row), row)

    def __contains__(self, key: Key) -> bool:
        return key in self.rows

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, key: Key) -> dict | None:
        return self.rows.get(key)

    def append(self, row: dict) -> None:
        key = row_key(row)
        if key in self.rows:
            raise ValueError(f"row {key} is already in {self.path}")
        line = encode_row(row)
        # O_APPEND + one write: the line lands whole at the end or (on a crash) partly, never
        # interleaved; fsync makes "written" mean "survives a power cut" before we count it.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            end = os.fstat(fd).st_size
            try:
                if os.write(fd, line) != len(line):  # a short write: the disk filled mid-line
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                os.fsync(fd)
            except OSError as e:
                os.ftruncate(fd, end)  # no partial line: the file ends at the last whole row
                raise disk_full(self.path, e) from e
        finally:
            os.close(fd)
        self.rows[key] = row


def merge(output: str | Path, inputs: Iterable[str | Path]) -> int:
    """Join shard files into ``output`` (written atomically): one row per key, the first seen
    winning, sorted by key so the result does not depend on the shards' order. Returns the row
    count."""
    merged: dict[Key, dict] = {}
    inputs = [Path(p) for p in inputs]
    for path in inputs:
        if not path.exists():
            raise FileNotFoundError(f"shard file {path} does not exist")
        for row in read_rows(path):
            merged.setdefault(row_key(row), row)
    write_rows(output, [merged[k] for k in sorted(merged)])
    return len(merged)


def write_rows(path: str | Path, rows: list[dict]) -> None:
    """Write a whole JSONL file atomically (temporary file + rename)."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(encode_row(row).decode())
        f.flush()
        os.fsync(f.fileno())


def without_timing(row: dict) -> dict:
    """The row minus its clock-derived fields: what two runs of the same work must agree on."""
    return {k: v for k, v in row.items() if k not in TIMING_FIELDS}
