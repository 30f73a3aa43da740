"""Training data: packing, padding, splits, per-domain sources kept apart from evaluation, local files."""

import json
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

import training.data as data
from serving.prompts import EVAL_ROWS, load_prompts
from training.data import (
    STDLIB_SKIP_DIRS,
    EvalOverlapError,
    assert_no_eval_overlap,
    find_eval_overlap,
    load_domain_texts,
    load_local_texts,
    pad_to_fixed,
    prompt_texts,
    split_train_val,
    stdlib_sources,
    tokenize_and_pack,
)

pytestmark = pytest.mark.unit

EOS = 2  # <|im_end|> in the conftest tokenizer


# --- packing and padding ----------------------------------------------------------------------


def test_pack_puts_eos_after_every_document_and_drops_the_partial_row(tokenizer):
    texts = ["def add(a, b):\n    return a + b\n", "The quick brown fox", "What is 12 + 30?"]
    stream = []
    for t in texts:
        stream += tokenizer.encode(t, add_special_tokens=False) + [EOS]
    rows = tokenize_and_pack(texts, tokenizer, seq_len=4, eos_id=EOS)
    assert rows.dtype == torch.long and rows.shape == (len(stream) // 4, 4)
    assert rows.flatten().tolist() == stream[: rows.numel()]
    assert (rows == EOS).sum() == stream[: rows.numel()].count(EOS) >= 2


def test_pack_too_little_text_gives_no_rows(tokenizer):
    assert tokenize_and_pack(["hi"], tokenizer, seq_len=64, eos_id=EOS).shape == (0, 64)
    assert tokenize_and_pack([], tokenizer, seq_len=8, eos_id=EOS).shape == (0, 8)
    with pytest.raises(ValueError, match="seq_len"):
        tokenize_and_pack(["hi"], tokenizer, seq_len=0, eos_id=EOS)


def test_pad_to_fixed_marks_padding_by_position():
    ids, labels = pad_to_fixed([[5, 0, 7], [9], [1, 2, 3, 4, 5, 6]], seq_len=4, pad_id=0)
    assert ids.tolist() == [[5, 0, 7, 0], [9, 0, 0, 0], [1, 2, 3, 4]]
    # The real token 0 (equal to pad_id) keeps its label; only padding positions get -100.
    assert labels.tolist() == [[5, 0, 7, -100], [9, -100, -100, -100], [1, 2, 3, 4]]
    assert pad_to_fixed([], 4, 0)[0].shape == (0, 4)


# --- splits -----------------------------------------------------------------------------------


def test_split_is_deterministic_disjoint_and_ignores_global_rng():
    rows = torch.arange(100).view(50, 2)  # [N, L]
    torch.manual_seed(0)
    expected_next = torch.rand(1)
    torch.manual_seed(0)
    train, val = split_train_val(rows, 0.2, seed=3)
    assert torch.equal(torch.rand(1), expected_next)  # the global RNG was not touched
    torch.manual_seed(123)  # nor does it matter
    train2, val2 = split_train_val(rows, 0.2, seed=3)
    assert torch.equal(train, train2) and torch.equal(val, val2)
    assert val.shape == (10, 2) and train.shape == (40, 2)
    got = set(train[:, 0].tolist()) | set(val[:, 0].tolist())
    assert not set(train[:, 0].tolist()) & set(val[:, 0].tolist()) and got == set(rows[:, 0].tolist())
    assert not torch.equal(split_train_val(rows, 0.2, seed=4)[1], val)


def test_split_lists_and_edge_fractions():
    rows = list("abcdefghij")
    train, val = split_train_val(rows, 0.3, seed=0)
    assert sorted(train + val) == rows and len(val) == 3
    assert train == sorted(train) and val == sorted(val)  # original order kept within each part
    assert split_train_val(rows, 0.0) == (rows, [])
    assert len(split_train_val(rows, 0.01)[1]) == 1
    assert split_train_val(["only"], 0.5) == (["only"], [])
    with pytest.raises(ValueError, match="val_fraction"):
        split_train_val(rows, 1.0)


# --- domains ----------------------------------------------------------------------------------


def test_stdlib_sources_skip_tests_and_vendored_packages():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_sources()
    assert files == sorted(files) and len(files) > 100
    assert all(f.suffix == ".py" and root in f.parents for f in files)
    assert not any(set(f.relative_to(root).parts[:-1]) & STDLIB_SKIP_DIRS for f in files)


def test_code_texts_come_from_stdlib_and_hold_no_humaneval_prompt():
    texts = load_domain_texts("code", 6, seed=1)
    assert len(texts) == 6 and texts == load_domain_texts("code", 6, seed=1)
    assert texts[:3] == load_domain_texts("code", 3, seed=1)
    sources = {f.read_text(encoding="utf-8") for f in stdlib_sources()}
    assert all(t in sources for t in texts)
    assert_no_eval_overlap(texts, load_prompts("code", 164))


def test_guard_finds_embedded_and_exact_prompts():
    humaneval = load_prompts("code", 2)
    texts = ["import os\n", "# header\n" + humaneval[1].text + "    pass\n", "hi"]
    assert find_eval_overlap(texts, humaneval) == [(1, "HumanEval/1")]
    with pytest.raises(EvalOverlapError, match="text 1 contains HumanEval/1"):
        assert_no_eval_overlap(texts, humaneval)
    # Short prompts count only as exact matches ("hi" is inside "this", which is no leak).
    assert find_eval_overlap(["this is fine", " hi "], ["hi"]) == [(1, "#0")]


def test_chat_training_prompts_start_past_the_evaluation_rows():
    texts = load_domain_texts("chat", 5)
    assert texts == [p.text for p in load_prompts("chat", 5, offset=EVAL_ROWS)]
    eval_prompts = load_prompts("chat", EVAL_ROWS)
    assert not set(texts) & {p.text for p in eval_prompts}
    assert_no_eval_overlap(texts, eval_prompts)


def test_chat_prompts_render_under_the_chat_template(tokenizer):
    raw = prompt_texts("chat", 2)
    rendered = load_domain_texts("chat", 2, tokenizer=tokenizer)
    assert rendered == [f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n" for t in raw]


def test_math_training_questions_are_disjoint_from_evaluation(tokenizer):
    texts = prompt_texts("math", 4, eval_rows=20)
    eval_texts = {p.text for p in load_prompts("math", 20)}
    assert not set(texts) & eval_texts
    assert texts == [p.text for p in load_prompts("math", 4, offset=20)]
    rendered = load_domain_texts("math", 4, tokenizer=tokenizer, eval_rows=20)
    assert rendered == [f"<|im_start|>user\n{t}<|im_end|>\n<|im_start|>assistant\n" for t in texts]


def test_math_drops_training_questions_equal_to_evaluation_ones(monkeypatch):
    first, second, third = (p.text for p in load_prompts("math", 3, offset=20))
    monkeypatch.setattr(data, "_eval_texts", lambda domain, rows: frozenset({first}))
    assert prompt_texts("math", 2, eval_rows=20) == [second, third]


def test_unknown_domain_names_the_valid_ones():
    with pytest.raises(ValueError, match=r"'poetry'.*code, chat, math"):
        load_domain_texts("poetry", 3)


# --- local files ------------------------------------------------------------------------------


def test_local_jsonl_and_txt(tmp_path):
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("\n".join(json.dumps({"text": t, "id": i}) for i, t in enumerate(["one\nline", "two", "three"])) + "\n\n")
    assert load_local_texts(jsonl) == ["one\nline", "two", "three"]
    assert load_domain_texts(str(jsonl), 2) == ["one\nline", "two"]
    txt = tmp_path / "book.txt"
    txt.write_text("a whole\n\nfile\n", encoding="utf-8")
    assert load_domain_texts(str(txt), 5) == ["a whole\n\nfile\n"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*'text'"):
        load_local_texts(bad)


def test_local_unsupported_paths(tmp_path):
    (tmp_path / "table.csv").write_text("text\nhello\n")
    with pytest.raises(ValueError, match=r"unsupported .*\.jsonl, \.txt, \.parquet"):
        load_local_texts(tmp_path / "table.csv")
    with pytest.raises(ValueError, match="not a datasets folder"):
        load_local_texts(tmp_path)


def test_parquet_without_pyarrow_is_a_clear_error(tmp_path, monkeypatch):
    # pyarrow is a dependency: a machine without it is made by hiding it (None in sys.modules fails its import)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    path = tmp_path / "docs.parquet"
    path.write_bytes(b"PAR1")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        load_local_texts(path)


def test_datasets_folder_without_datasets_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    (tmp_path / "dataset_info.json").write_text("{}")
    with pytest.raises(ImportError, match="pip install datasets"):
        load_local_texts(tmp_path)


def test_function_stubs_are_humaneval_shaped():
    from training.data import function_stubs

    source = '''import os
from typing import List


def keep(xs: List[int], limit: int) -> List[int]:
    """Return the items of xs that are below limit, in their original order."""
    out = [x for x in xs if x < limit]
    return out


def _private(x):
    """A private helper whose docstring is long enough to count otherwise."""
    return x


def short(x):
    """Too short."""
    return x
'''
    stubs = function_stubs([source, "def broken(:\n"], 10)
    assert stubs == [
        'import os\nfrom typing import List\n\n\n'
        'def keep(xs: List[int], limit: int) -> List[int]:\n'
        '    """Return the items of xs that are below limit, in their original order."""\n'
    ]
    assert function_stubs([source] * 5, 2) == stubs * 2  # stops at n
