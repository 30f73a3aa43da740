"""Router configs and CLIs reject bad input clearly; the rows file survives a torn last line and
refuses damage in the middle; merge deduplicates and sorts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from routing.cli import collect_main, train_main
from routing.collect import parse_shard, shard_output
from routing.config import CollectConfig, RouterTrainConfig
from routing.rows import RowStore, merge, read_rows
from serving.config import ConfigError, load_config

pytestmark = pytest.mark.unit


CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# User configs at the top, experiment records' configs under experiments/: names relative to configs/.
COLLECT_CONFIGS = sorted(str(p.relative_to(CONFIGS).with_suffix("")) for p in CONFIGS.glob("**/router_collect*.yaml"))


def test_the_collect_configs_are_found():
    assert {"router_collect", "experiments/router_collect_math_spec", "experiments/router_collect_math_spec_test",
            "experiments/router_collect_math_spec_fresh"} <= set(COLLECT_CONFIGS)


@pytest.mark.parametrize("name", COLLECT_CONFIGS)
def test_shipped_configs_load(name):
    cfg = load_config(CollectConfig, CONFIGS / f"{name}.yaml")
    assert cfg.baseline and cfg.drafts and {s.domain for s in cfg.sources} == {"code", "chat", "math"}
    with open(CONFIGS / f"{name}.yaml") as f:
        assert f.readline().startswith(f"# collect-router-data --config configs/{name}.yaml")


@pytest.mark.parametrize(
    "test_name, train_names",
    [
        ("experiments/router_collect_math_spec_test", ["experiments/router_collect_math_spec"]),
        ("experiments/router_collect_math_spec_fresh", ["experiments/router_collect_math_spec", "experiments/router_collect_math_spec_test"]),
    ],
)
def test_the_fresh_test_sets_share_no_prompt_with_the_rows_they_test(test_name, train_names):
    test = load_config(CollectConfig, CONFIGS / f"{test_name}.yaml")

    def rows(cfg, domain):
        return {r for s in cfg.sources if s.domain == domain for r in range(s.offset, s.offset + s.n)}

    for name in train_names:
        train = load_config(CollectConfig, CONFIGS / f"{name}.yaml")
        assert (test.target, test.drafts, test.decode, test.engine) == (train.target, train.drafts, train.decode, train.engine)
        for domain in ("code", "chat", "math"):
            assert rows(test, domain) and not rows(test, domain) & rows(train, domain)
    assert max(rows(test, "code")) < 164  # HumanEval has 164 problems: more rows would silently be fewer prompts


def test_shipped_router_train_config_loads():
    assert load_config(RouterTrainConfig, CONFIGS / "router_train.yaml").objective == "acceptance"


@pytest.mark.parametrize(
    "cls, overrides, message",
    [
        (CollectConfig, ["decode.kk=4"], "unknown key decode.'kk'; valid keys under decode"),
        (CollectConfig, ["colour=red"], "unknown key 'colour'"),
        (CollectConfig, ["drafts={none: x}"], "'none' is reserved"),
        (CollectConfig, ["sources=[{n: 3}]"], "exactly one of `domain`, `family` or `file`"),
        (CollectConfig, ["sources=[{family: edit, n: 3}]"], "`family` and `split` go together"),
        (CollectConfig, ["sources=[{family: poetry, split: test, n: 3}]"], "poetry"),
        (CollectConfig, ["sources=[{domain: code}]"], "needs `n`"),
        (CollectConfig, ["sources=[{domain: poetry, n: 3}]"], "sources"),
        (CollectConfig, ["sources=[{file: a.txt}]", "decode.modes=[beam]"], "must be one of 'greedy', 'sampled'"),
        (CollectConfig, ["sources=[{file: a.txt}]", "output=rows.csv"], "must be a .jsonl file"),
        (RouterTrainConfig, ["objective=latency"], "objective='latency' must be one of"),
        (RouterTrainConfig, ["mlp.hiden=64"], "unknown key mlp.'hiden'"),
        (RouterTrainConfig, ["split.test_fraction=0.95"], "test_fraction=0.95"),
        (RouterTrainConfig, ["select.folds=1"], "folds=1 must be 0"),
        (RouterTrainConfig, ["select.mlp={hiden: [32]}"], r"unknown settings \['hiden'\]; choose from"),
        (RouterTrainConfig, ["select.mlp={dropout: [1.5]}"], "dropout=1.5 must be in"),
        (RouterTrainConfig, ["select.knn_k=[0, 5]"], "knn_k="),
        (RouterTrainConfig, ["shrink=1.5"], r"shrink=1.5 must be in \[0, 1\]"),
        (RouterTrainConfig, ["select.shrink=[0.5, -0.1]"], r"select.shrink=-0.1 must be in \[0, 1\]"),
    ],
)
def test_bad_config_values_name_the_key(cls, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(cls, None, overrides)


def test_clis_report_bad_config_and_input(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("target: t\nsourcez: []\n")
    assert collect_main(["--config", str(bad)]) == 2
    assert "unknown key 'sourcez'" in capsys.readouterr().err
    assert train_main(["mlp.epochs=0"]) == 2
    assert "epochs=0 must be >= 1" in capsys.readouterr().err
    assert collect_main(["sources=[{file: missing.jsonl}]"]) == 2
    assert "missing.jsonl does not exist" in capsys.readouterr().err
    assert train_main([f"data=[{tmp_path / 'none.jsonl'}]", f"output={tmp_path / 'r'}"]) == 2
    assert "run collect-router-data first" in capsys.readouterr().err
    assert collect_main(["--show-config"]) == 0 and "engine.k: int | str = 4" in capsys.readouterr().out
    old = tmp_path / "old.yaml"
    old.write_text("decode:\n  k: 4\nengine:\n  batch_size: 2\n")
    assert collect_main(["--config", str(old)]) == 2
    assert capsys.readouterr().err == (f"collect-router-data: error: {old}: keys were renamed: engine.batch_size -> "
                                       "engine.max_batch_size, decode.k -> engine.k; use the new keys\n")
    assert collect_main(["sources=[{file: a.txt}]", "engine.k=auto"]) == 2
    assert "engine.k='auto': each row measures one K; give an integer" in capsys.readouterr().err


def test_shard_spec():
    assert parse_shard("1/3") == (1, 3)
    for bad in ("3/3", "1-3", "a/b", "-1/2"):
        with pytest.raises(ValueError, match="shard"):
            parse_shard(bad)
    assert shard_output("d/rows.jsonl", (0, 2)).name == "rows.shard0of2.jsonl"
    assert shard_output("d/rows.jsonl", None).name == "rows.jsonl"


def row(pid, draft="a", mode="greedy", repeat=0, **extra):
    return {"prompt_id": pid, "draft": draft, "mode": mode, "repeat": repeat, **extra}


def test_row_store_repairs_a_torn_last_line_and_refuses_middle_damage(tmp_path):
    path = tmp_path / "rows.jsonl"
    store = RowStore(path)
    store.append(row("p1"))
    store.append(row("p2"))
    with pytest.raises(ValueError, match="already in"):
        store.append(row("p1"))
    with open(path, "a") as f:
        f.write('{"prompt_id": "p3", "dr')  # a crash mid-write
    assert len(read_rows(path)) == 2  # read-only readers skip it
    store = RowStore(path)  # opening for appending cuts it off
    assert len(store) == 2 and path.read_text().endswith("\n")
    store.append(row("p3"))
    assert [r["prompt_id"] for r in read_rows(path)] == ["p1", "p2", "p3"]

    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], "{broken", lines[2]]) + "\n")
    with pytest.raises(ValueError, match="rows.jsonl:2 is not a collected row"):
        RowStore(path)


def test_a_flipped_byte_in_a_collected_row_is_refused_with_its_line(tmp_path):
    """Each line carries the crc32 of its row: a digit changed on disk is named, not learnt from;
    rows written before the checksum existed still read."""
    path = tmp_path / "rows.jsonl"
    store = RowStore(path)
    store.append(row("p1", speedup=1.25))
    store.append(row("p2", speedup=1.5))
    assert [r.get("crc32") for r in read_rows(path)] == [None, None]  # the checksum is the file's, not the row's
    path.write_bytes(path.read_bytes().replace(b"1.5", b"1.6"))
    with pytest.raises(ValueError, match=r"rows.jsonl:2 is not a collected row \(its crc32 [0-9a-f]{8} does not match"):
        RowStore(path)
    path.write_text(json.dumps(row("p1", speedup=1.25)) + "\n")  # an older file, no checksums
    assert read_rows(path) == [row("p1", speedup=1.25)]


def test_every_single_byte_damage_of_a_checksummed_row_is_refused_or_changes_nothing(tmp_path):
    """Each byte of a row's line (its checksum's key included) replaced by each other byte value:
    the file is refused, or it reads back the same rows (a space turned into a tab, say); never
    a changed row read as an older unchecked one."""
    path = tmp_path / "rows.jsonl"
    store = RowStore(path)
    store.append(row("p1", speedup=1.25))
    first = path.read_bytes()
    store.append(row("p2", speedup=1.5))
    for good, start in [(first, 0), (path.read_bytes(), len(first))]:  # a file of one row; the second row of two
        path.write_bytes(good)
        want = read_rows(path)
        damaged = bytearray(good)
        changed = 0
        for i in range(start, len(good) - 1):  # the line, its newline kept
            for value in range(256):
                if value == good[i]:
                    continue
                damaged[i] = value
                path.write_bytes(bytes(damaged))
                try:
                    got = read_rows(path)
                except ValueError:
                    continue
                finally:
                    damaged[i] = good[i]
                assert got == want, (i, bytes([value]), got)
                changed += 1
        assert changed < 256 * 4  # only whitespace-like bytes may read back as the same rows
    legacy = tmp_path / "mixed.jsonl"  # a row without a checksum beside checksummed ones
    legacy.write_bytes(first + (json.dumps(row("p3")) + "\n").encode())
    with pytest.raises(ValueError, match=r"mixed.jsonl:2 .*has no crc32 where the file's first row has one"):
        read_rows(legacy)


def test_merge_dedupes_by_key_and_sorts(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text("".join(json.dumps(r) + "\n" for r in [row("p2", x=1), row("p1", x=2)]))
    b.write_text("".join(json.dumps(r) + "\n" for r in [row("p1", x=3), row("p1", draft="b")]))
    out = tmp_path / "out.jsonl"
    assert merge(out, [a, b]) == 3
    assert [(r["prompt_id"], r["draft"], r.get("x")) for r in read_rows(out)] == [("p1", "a", 2), ("p1", "b", None), ("p2", "a", 1)]
    assert collect_main(["--merge", str(out), str(tmp_path / "missing.jsonl")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_row_with_integer_keys_reads_back_and_a_crc32_field_is_refused(tmp_path):
    store = RowStore(tmp_path / "rows.jsonl")
    store.append(row("p1", hist={9: 1, 10: 2}))  # int keys come back as strings, in another sort order
    assert read_rows(tmp_path / "rows.jsonl")[0]["hist"] == {"9": 1, "10": 2}
    with pytest.raises(ValueError, match="may not hold a field named 'crc32'"):
        store.append(row("p2", crc32="x"))
