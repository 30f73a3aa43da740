"""Prompt loaders: determinism, ids, offsets, errors and user prompt files."""

import json
import random

import pytest

from serving.prompts import DOMAINS, Prompt, as_chat, load_mixed, load_prompts, read_prompt_file

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("domain", DOMAINS)
def test_loads_three_deterministically(domain):
    first = load_prompts(domain, 3)
    assert first == load_prompts(domain, 3)
    assert len(first) == 3
    assert len({p.id for p in first}) == 3
    assert all(p.domain == domain and p.text.strip() for p in first)
    assert all(p.use_chat_template == (domain != "code") for p in first)


@pytest.mark.parametrize("domain", DOMAINS)
def test_offset_takes_disjoint_rows_of_one_sequence(domain):
    head = load_prompts(domain, 3)
    tail = load_prompts(domain, 3, offset=3)
    assert not {p.id for p in head} & {p.id for p in tail}
    assert not {p.text for p in head} & {p.text for p in tail}
    assert head + tail == load_prompts(domain, 6)


def test_code_is_humaneval_in_task_order():
    assert [p.id for p in load_prompts("code", 3)] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert len(load_prompts("code", 1000)) == 164


def test_math_seed_changes_questions_and_leaves_global_rng_alone():
    random.seed(123)
    expected = random.random()
    random.seed(123)
    assert load_prompts("math", 3, seed=1) != load_prompts("math", 3, seed=0)
    assert random.random() == expected
    assert load_prompts("math", 1)[0].id.startswith("math/")


def test_unknown_domain_names_value_and_choices():
    with pytest.raises(ValueError, match=r"'poetry'.*code, chat, math"):
        load_prompts("poetry", 3)


def test_load_mixed_concatenates_domains():
    mixed = load_mixed(2)
    assert [p.domain for p in mixed] == ["code", "code", "chat", "chat", "math", "math"]


def test_as_chat():
    assert as_chat("hi") == [{"role": "user", "content": "hi"}]


def test_read_txt_one_prompt_per_line(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("first prompt\n\n  second prompt\n", encoding="utf-8")
    assert read_prompt_file(path) == [
        Prompt("unknown", "mine/1", "first prompt"),
        Prompt("unknown", "mine/3", "  second prompt"),
    ]


def test_read_jsonl(tmp_path):
    rows = [
        {"text": "Solve 2*x = 4 for x.", "domain": "math", "id": "q1"},
        {"prompt": "def f(x):\n    ", "domain": "code"},
        {"text": "hello", "use_chat_template": False},
    ]
    path = tmp_path / "mine.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n", encoding="utf-8")
    assert read_prompt_file(path) == [
        Prompt("math", "q1", "Solve 2*x = 4 for x.", True),
        Prompt("code", "mine/2", "def f(x):\n    ", False),
        Prompt("unknown", "mine/3", "hello", False),
    ]


def test_read_rejects_bad_files(tmp_path):
    bad_domain = tmp_path / "a.jsonl"
    bad_domain.write_text(json.dumps({"text": "x", "domain": "maths"}), encoding="utf-8")
    with pytest.raises(ValueError, match="'maths'"):
        read_prompt_file(bad_domain)
    no_text = tmp_path / "b.jsonl"
    no_text.write_text(json.dumps({"id": "x"}), encoding="utf-8")
    with pytest.raises(ValueError, match="b.jsonl:1"):
        read_prompt_file(no_text)
    with pytest.raises(ValueError, match="expected .txt or .jsonl"):
        read_prompt_file(tmp_path / "c.csv")
