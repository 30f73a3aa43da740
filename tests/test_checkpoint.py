"""Checkpoint manifests (training.checkpoint): every file's size and sha256, checked on resume."""

import json

import pytest

from training.checkpoint import CheckpointError, resumable, verify, write_manifest

pytestmark = pytest.mark.unit

FILES = {"progress.json": b'{"step": 3}', "state/model.safetensors": bytes(range(256)) * 4, "state/scheduler.bin": b"sched"}


def checkpoint(folder, files=FILES):
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    write_manifest(folder)
    return folder


def test_an_intact_checkpoint_verifies_and_one_without_a_manifest_is_refused_unless_asked(tmp_path):
    assert verify(checkpoint(tmp_path / "last")) is True
    listed = json.loads((tmp_path / "last" / "manifest.json").read_text())["files"]
    assert sorted(listed) == sorted(FILES)
    (tmp_path / "old").mkdir()
    with pytest.raises(CheckpointError, match="manifest.json.*output.resume_unchecked=true"):
        verify(tmp_path / "old")
    assert verify(tmp_path / "old", unchecked=True) is False


def test_a_deleted_manifest_is_refused_on_resume_or_resumed_unchecked_by_name(tmp_path):
    # A flipped byte in a checkpoint whose manifest was deleted would otherwise load unnoticed.
    checkpoint(tmp_path / "last")
    (tmp_path / "last" / "manifest.json").unlink()
    (tmp_path / "last" / "state" / "scheduler.bin").write_bytes(b"schex")
    with pytest.raises(CheckpointError, match=r"last has no manifest\.json"):
        resumable(tmp_path)
    said = []
    assert resumable(tmp_path, log=said.append, unchecked=True) == tmp_path / "last"
    assert len(said) == 1 and "UNCHECKED" in said[0] and "output.resume_unchecked=true" in said[0]
    checkpoint(tmp_path / "previous")  # a checked one to fall back to is taken first
    assert resumable(tmp_path, log=said.append) == tmp_path / "previous" and "no manifest.json" in said[-1]


@pytest.mark.parametrize("name", sorted(FILES))
@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "delete"])
def test_any_damaged_file_is_refused_by_name(tmp_path, name, damage):
    folder = checkpoint(tmp_path / "last")
    path = folder / name
    data = bytearray(path.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x01  # one bit of one byte
        path.write_bytes(bytes(data))
    elif damage == "truncate":
        path.write_bytes(bytes(data[:-1]))
    elif damage == "empty":
        path.write_bytes(b"")
    else:
        path.unlink()
    with pytest.raises(CheckpointError) as info:
        verify(folder)
    message = str(info.value)
    assert str(path) in message and "\n" not in message


def test_a_file_added_after_the_manifest_or_a_garbage_manifest_is_refused(tmp_path):
    folder = checkpoint(tmp_path / "last")
    (folder / "state" / "extra.bin").write_bytes(b"?")
    with pytest.raises(CheckpointError, match="extra.bin"):
        verify(folder)
    (folder / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json"):
        verify(folder)


def test_resume_falls_back_to_previous_when_last_is_damaged(tmp_path):
    assert resumable(tmp_path) is None  # nothing saved yet
    checkpoint(tmp_path / "previous")
    checkpoint(tmp_path / "last")
    assert resumable(tmp_path) == tmp_path / "last"
    (tmp_path / "last" / "state" / "scheduler.bin").write_bytes(b"schex")
    said = []
    assert resumable(tmp_path, log=said.append) == tmp_path / "previous"
    assert len(said) == 1 and "scheduler.bin" in said[0] and "previous" in said[0]
    (tmp_path / "previous" / "progress.json").write_bytes(b'{"step": 4}')
    with pytest.raises(CheckpointError, match=r"last/state/scheduler\.bin"):  # the first damage found is named
        resumable(tmp_path)


@pytest.mark.integration
def test_a_truncated_model_file_is_named_when_it_is_loaded(tmp_path, tiny_target):
    """A model folder whose safetensors file was cut short: the load error names the folder and
    the file, where safetensors alone says only 'Error while deserializing header'."""
    from serving.engine.models import ModelLoadError, load_model

    tiny_target.save_pretrained(tmp_path / "draft")
    weights = tmp_path / "draft" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ModelLoadError) as info:
        load_model(str(tmp_path / "draft"))
    assert str(tmp_path / "draft") in str(info.value) and "model.safetensors" in str(info.value)


def test_hidden_files_are_not_part_of_a_checkpoint(tmp_path):
    folder = checkpoint(tmp_path / "last")
    (folder / ".DS_Store").write_bytes(b"finder")
    (folder / "state" / ".nfs0001").write_bytes(b"nfs")
    assert verify(folder) is True


def test_a_manifest_with_malformed_entries_is_refused_by_name(tmp_path):
    folder = checkpoint(tmp_path / "last")
    (folder / "manifest.json").write_text(json.dumps({"format": 1, "files": {"progress.json": "abc"}}))
    with pytest.raises(CheckpointError, match="manifest.json is damaged"):
        verify(folder)
    (folder / "manifest.json").write_text(json.dumps({"format": 1, "files": {"progress.json": {"sha256": "x"}}}))
    with pytest.raises(CheckpointError, match="manifest.json is damaged"):
        verify(folder)


def test_a_damaged_last_never_replaces_a_good_previous(tmp_path):
    from training.checkpoint import keep_previous

    checkpoint(tmp_path / "previous")
    checkpoint(tmp_path / "last")
    (tmp_path / "last" / "progress.json").write_bytes(b'{"step": 9}')  # damaged after it was written
    keep_previous(tmp_path / "last")  # what the next save does first
    assert not (tmp_path / "last").exists() and verify(tmp_path / "previous") is True
    assert resumable(tmp_path) == tmp_path / "previous"
    checkpoint(tmp_path / "last")
    keep_previous(tmp_path / "last")  # a good last becomes previous
    assert not (tmp_path / "last").exists() and verify(tmp_path / "previous") is True
