"""Prompt loaders: determinism, ids, offsets, errors and user prompt files."""

import json
import random

import pytest

from serving.prompts import (
    ALL_DOMAINS,
    DOMAINS,
    GROUNDED_DOMAINS,
    GROUNDED_MAX_TOKENS,
    Prompt,
    as_chat,
    encode_prompt,
    estimate_tokens,
    load_grounded,
    load_mixed,
    load_prompts,
    read_prompt_file,
    resolve_domains,
)

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


# --- input-grounded domains -------------------------------------------------------------------

GROUNDED_ROWS = 12
MAX_PROMPT_TOKENS = 600  # with the chat template; spec-bench runs at max_len ~1024


@pytest.mark.parametrize("domain", GROUNDED_DOMAINS)
def test_grounded_family_gives_distinct_deterministic_prompts_within_budget(domain):
    rows = load_prompts(domain, GROUNDED_ROWS)
    assert rows == load_prompts(domain, GROUNDED_ROWS)
    assert len(rows) == GROUNDED_ROWS
    assert len({p.id for p in rows}) == len({p.text for p in rows}) == GROUNDED_ROWS
    assert all(p.domain == domain and p.id.startswith(f"{domain}/") and p.use_chat_template for p in rows)
    assert all(estimate_tokens(p.text) <= GROUNDED_MAX_TOKENS for p in rows)
    assert load_prompts(domain, 4, offset=8) == rows[8:]


@pytest.mark.parametrize("domain", GROUNDED_DOMAINS)
def test_grounded_prompt_contains_its_source_and_quotes(domain):
    rows = load_grounded(domain, GROUNDED_ROWS)
    assert [g.prompt for g in rows] == load_prompts(domain, GROUNDED_ROWS)
    for g in rows:
        assert len(g.source) >= 100
        assert g.source in g.prompt.text  # verbatim: what a prompt-lookup drafter can copy from
        assert all(q and q in g.source for q in g.quotes)
        assert g.quotes or domain == "summarize"


def test_grounded_edit_names_the_variable_it_renames():
    rename = [g for g in load_grounded("edit", GROUNDED_ROWS) if g.prompt.text.startswith("Rename")]
    assert rename
    for g in rename:
        assert f"`{g.quotes[1]}`" in g.prompt.text and f"def {g.quotes[0]}(" in g.source


@pytest.mark.bundled
def test_grounded_prompts_fit_the_qwen_tokenizer_budget():
    # Checks the tokenizer-free estimate against the real count, with the bundled target's own
    # tokenizer (converted on first use, as every bundled test does; never left to another test).
    from serving.engine.models import load_tokenizer

    tokenizer = load_tokenizer("qwen2.5-coder-1.5b-instruct")
    for domain in GROUNDED_DOMAINS:
        for p in load_prompts(domain, GROUNDED_ROWS):
            assert len(encode_prompt(tokenizer, p)) <= MAX_PROMPT_TOKENS, p.id


def test_grounded_group_expands_to_its_domains():
    assert resolve_domains(["code", "grounded", "edit"]) == ["code", *GROUNDED_DOMAINS]
    grouped = load_prompts("grounded", 2)
    assert [p.domain for p in grouped] == [d for d in GROUNDED_DOMAINS for _ in range(2)]
    assert grouped == [p for d in GROUNDED_DOMAINS for p in load_prompts(d, 2)]


def test_unknown_domain_error_names_it_and_every_valid_name():
    for call in (lambda: load_prompts("quotes", 3), lambda: resolve_domains(["code", "quotes"])):
        with pytest.raises(ValueError, match="'quotes'") as error:
            call()
        assert all(name in str(error.value) for name in (*ALL_DOMAINS, "grounded"))
    with pytest.raises(ValueError, match=r"'code'.*edit, extract, summarize, quoted"):
        load_grounded("code", 3)
