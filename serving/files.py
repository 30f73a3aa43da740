"""Files written whole or not at all, shared by every command that writes results.

    with atomic_path(Path("runs/router.pt")) as tmp:
        tmp.write_bytes(payload)        # renamed over the path only once written

A temporary sibling is renamed over the path when the block ends; on any error it is removed, so
an interrupted or failed write leaves neither a half-written file nor a stray temporary. A full
disk (ENOSPC, or EDQUOT for a quota) is reported as one ``OSError`` naming the path and the folder
to free space in, instead of the bare "No space left on device" of whichever call hit it.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(path: Path, error: OSError) -> OSError:
    """``error`` as the one line a user needs when the disk is full; other errors unchanged."""
    if error.errno not in FULL:
        return error
    return OSError(error.errno, f"no space left for {path} (the disk or quota holding {Path(path).parent} is full); "
                                "free space there and run again: nothing partial was left behind")  # fmt: skip


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; renamed over ``path`` when the block ends, removed
    when it raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if isinstance(e, OSError) and e.errno in FULL:
            raise disk_full(path, e) from e
        raise
