"""Fast tests of serving.engine.bundled with fake part files: no real weights, no GGUF parsing."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from serving.engine import bundled
from serving.engine.bundled import BundledModelError, BundledSpec

pytestmark = pytest.mark.unit


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Three fake parts on disk, with metadata lookup pointed at them."""
    chunks = [b"alpha-" * 1000, b"beta-" * 777, b"gamma"]
    paths = []
    for i, data in enumerate(chunks, 1):
        p = tmp_path / "site" / f"fake_part{i}" / "data" / f"part{i:02d}.bin"
        p.parent.mkdir(parents=True)
        p.write_bytes(data)
        paths.append(p)
    joined = b"".join(chunks)
    spec = BundledSpec(
        name="fake-model",
        dists=("fake-part1", "fake-part2", "fake-part3"),
        sha256=hashlib.sha256(joined).hexdigest(),
        size=len(joined),
        gguf_name="fake.gguf",
    )
    by_dist = dict(zip(spec.dists, paths))

    class _PackagePath:
        def __init__(self, path):
            self._path = path
            self.parent = Path(path.parent.name)
            self.name = path.name

        def __lt__(self, other):
            return self.name < other.name

        def locate(self):
            return self._path

    def files(dist):
        if dist not in by_dist:
            raise bundled.importlib.metadata.PackageNotFoundError(dist)
        return [_PackagePath(by_dist[dist])]

    monkeypatch.setattr(bundled.importlib.metadata, "files", files)
    return spec, joined, by_dist, tmp_path / "home"


def _recording_convert(calls):
    def convert(gguf: Path, out: Path):
        calls.append(gguf.read_bytes())
        out.mkdir()
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"weights")

    return convert


def test_names_and_home(monkeypatch, tmp_path):
    assert bundled.BUNDLED_NAMES == ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct")
    assert bundled.is_bundled_name("qwen2.5-coder-0.5b-instruct")
    assert not bundled.is_bundled_name("Qwen/Qwen2.5-Coder-0.5B-Instruct")
    monkeypatch.setenv("CHORAL_HOME", str(tmp_path))
    assert bundled.choral_home() == tmp_path
    monkeypatch.delenv("CHORAL_HOME")
    assert bundled.choral_home() == Path.home() / ".cache" / "choral"
    with pytest.raises(KeyError):
        bundled.resolve_bundled("no-such-model", home=tmp_path)


def test_real_specs_are_consistent():
    for name in bundled.BUNDLED_NAMES:
        spec = bundled._SPECS[name]
        assert len(spec.sha256) == 64 and spec.size > 0 and spec.gguf_name.endswith(".gguf")


def test_converts_once_then_fast_path(fake):
    spec, joined, _, home = fake
    calls = []
    out = bundled._resolve(spec, home, convert=_recording_convert(calls))
    assert out == home / "models" / spec.name
    assert calls == [joined]  # parts joined in order
    assert (out / "model.safetensors").read_bytes() == b"weights"
    # Only the finished folder is left: no joined GGUF, no temp folders.
    assert sorted(p.name for p in (home / "models").iterdir()) == [spec.name]
    assert bundled._resolve(spec, home, convert=_recording_convert(calls)) == out
    assert len(calls) == 1


def test_sha256_mismatch_refuses_and_cleans_up(fake):
    spec, _, by_dist, home = fake
    by_dist["fake-part2"].write_bytes(b"BETA-" * 777)  # same size, different bytes
    calls = []
    with pytest.raises(BundledModelError, match="sha256"):
        bundled._resolve(spec, home, convert=_recording_convert(calls))
    assert calls == []
    assert list((home / "models").iterdir()) == []  # temp GGUF and work folder deleted


def test_size_mismatch_refuses(fake):
    spec, _, by_dist, home = fake
    by_dist["fake-part3"].write_bytes(b"gamma!")
    with pytest.raises(BundledModelError, match="bytes"):
        bundled._resolve(spec, home, convert=_recording_convert([]))


def test_missing_part_names_the_extra(fake):
    spec, _, _, home = fake
    spec = BundledSpec(spec.name, spec.dists + ("fake-part4",), spec.sha256, spec.size, spec.gguf_name)
    with pytest.raises(BundledModelError, match=r"fake-part4.*choral\[bundled\]"):
        bundled._resolve(spec, home, convert=_recording_convert([]))
    assert not (home / "models").exists()


def test_interrupted_conversion_leaves_no_done_folder(fake):
    spec, _, _, home = fake

    def crash(gguf, out):
        out.mkdir()
        (out / "config.json").write_text("{}")  # looks complete, but the build dies
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        bundled._resolve(spec, home, convert=crash)
    assert list((home / "models").iterdir()) == []
    # A later call starts over and succeeds.
    calls = []
    assert (bundled._resolve(spec, home, convert=_recording_convert(calls)) / "config.json").is_file()
    assert len(calls) == 1


def test_half_written_leftover_is_ignored(fake):
    spec, _, _, home = fake
    leftover = home / "models" / f".{spec.name}.dead"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    calls = []
    bundled._resolve(spec, home, convert=_recording_convert(calls))
    assert len(calls) == 1


def test_bundled_gguf_joins_once_and_refuses_a_bad_join(fake, monkeypatch):
    """The original GGUF for peers (llama.cpp): joined and checked once, then found; a part that
    changed leaves no file behind."""
    spec, joined, by_dist, home = fake
    monkeypatch.setitem(bundled._SPECS, spec.name, spec)
    path = bundled.bundled_gguf(spec.name, home=home)
    assert path == home / "gguf" / "fake.gguf" and path.read_bytes() == joined
    by_dist["fake-part1"].write_bytes(b"ALPHA-" * 1000)  # the file exists: not read again
    assert bundled.bundled_gguf(spec.name, home=home) == path
    path.unlink()
    with pytest.raises(BundledModelError, match="sha256"):
        bundled.bundled_gguf(spec.name, home=home)
    assert list((home / "gguf").iterdir()) == []


def test_gguf_parsed_once_reads_the_same_file(tmp_path):
    """The read-once reader sees the fields and tensors the library's own reader sees, parses a
    file once per block, and puts the library's reader back afterwards."""
    import gguf
    import numpy as np

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "<|im_end|>"] * 50)
    writer.add_uint32("qwen2.block_count", 2)
    weights = np.arange(96, dtype=np.float32).reshape(3, 32)
    writer.add_tensor("blk.0.attn_q.weight", weights)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    plain = gguf.GGUFReader(path)
    with bundled.gguf_parsed_once():
        once = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is once  # the second call reuses the first parse
    assert gguf.GGUFReader is not None and gguf.GGUFReader(path) is not once  # the library's reader is back
    assert list(once.fields) == list(plain.fields)
    for name, field in plain.fields.items():
        assert [p.tobytes() for p in once.fields[name].parts] == [p.tobytes() for p in field.parts], name
    [t_plain], [t_once] = plain.tensors, once.tensors
    assert t_once.name == t_plain.name
    np.testing.assert_array_equal(t_once.data, t_plain.data)
    np.testing.assert_array_equal(t_once.data, weights)


def test_a_full_disk_while_converting_names_the_folder_and_leaves_nothing(fake):
    spec, _, _, home = fake

    def full(gguf: Path, out: Path):
        out.mkdir()
        (out / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("Error while serializing: I/O error: No space left on device (os error 28)")  # safetensors' form

    with pytest.raises(BundledModelError, match=r"no space left in .*models.*CHORAL_HOME"):
        bundled._resolve(spec, home, convert=full)
    assert [p.name for p in (home / "models").iterdir()] == []
