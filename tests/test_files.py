"""Writes that leave nothing partial behind, and name the path when the disk is full."""

import errno
import os

import pytest

from serving.files import atomic_path
from training.checkpoint import atomic_dir

pytestmark = pytest.mark.unit


def full(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_atomic_path_renames_when_written_and_removes_the_temporary_on_error(tmp_path):
    path = tmp_path / "out.json"
    with atomic_path(path) as tmp:
        tmp.write_text("one")
    assert path.read_text() == "one"
    with pytest.raises(RuntimeError), atomic_path(path) as tmp:
        tmp.write_text("two, half")
        raise RuntimeError("interrupted")
    assert path.read_text() == "one" and leftovers(tmp_path) == []


def test_a_full_disk_names_the_path_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "out.json"
    with pytest.raises(OSError) as info, atomic_path(path) as tmp:
        tmp.write_text("partial")
        full()
    assert info.value.errno == errno.ENOSPC and str(path) in str(info.value) and str(tmp_path) in str(info.value)
    assert not path.exists() and leftovers(tmp_path) == []


def test_a_checkpoint_folder_on_a_full_disk_leaves_nothing(tmp_path):
    with pytest.raises(OSError, match="no space left for .*last"), atomic_dir(tmp_path / "last") as tmp:
        (tmp / "model.safetensors").write_bytes(b"x" * 10)
        full()
    assert list(tmp_path.iterdir()) == []


def test_router_save_on_a_full_disk_leaves_no_temporary(tmp_path, monkeypatch):
    from routing import router_file
    from routing.router import Router

    router = Router.create({"d": "models/d"}, "t", seed=0)
    monkeypatch.setattr(router_file.os, "fsync", full)
    with pytest.raises(OSError, match="router.pt"):
        router.save(tmp_path / "router.pt")
    assert list(tmp_path.iterdir()) == []


def test_a_collected_row_on_a_full_disk_leaves_no_partial_line(tmp_path, monkeypatch):
    from routing import rows as rows_mod

    store = rows_mod.RowStore(tmp_path / "rows.jsonl")
    store.append({"prompt_id": "a", "draft": "none", "mode": "greedy", "repeat": 0, "domain": "code"})
    before = (tmp_path / "rows.jsonl").read_bytes()
    real_write = os.write
    monkeypatch.setattr(rows_mod.os, "write", lambda fd, data: real_write(fd, data[: len(data) // 2]))  # the disk fills mid-line
    with pytest.raises(OSError, match="rows.jsonl"):
        store.append({"prompt_id": "b", "draft": "none", "mode": "greedy", "repeat": 0, "domain": "code"})
    assert (tmp_path / "rows.jsonl").read_bytes() == before and len(store) == 1
