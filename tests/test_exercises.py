"""Code exercises the target writes itself (training/exercises.py): parsing, the HumanEval guard,
the cache, and their use as on-policy prompts."""

import json

import pytest

from serving.prompts import load_prompts
from serving.config import load_config
from tests.conftest import tiny_qwen2
from training import exercises as ex
from training.config import TrainDraftConfig

GOOD = ' pair_sums(values: List[int]) -> List[int]:\n    """Sums of neighbours.\n    >>> pair_sums([1, 2, 3])\n    [3, 5]\n    '


@pytest.mark.unit
def test_parse_stub_keeps_a_humaneval_shaped_function_and_imports_its_typing_names():
    stub = ex.parse_stub(GOOD)
    assert stub.startswith("from typing import List\n\n\ndef pair_sums(values: List[int]) -> List[int]:\n")
    assert stub.endswith('    [3, 5]\n    """\n')
    assert ex.parse_stub(' f(x: int) -> int:\n    """Twice x.\n    >>> f(2)\n    4\n    ') == (
        'def f(x: int) -> int:\n    """Twice x.\n    >>> f(2)\n    4\n    """\n')  # no typing names, no import


@pytest.mark.unit
@pytest.mark.parametrize("generated", [
    ' f(x: int) -> int:\n    """Twice x, but no example.\n    ',               # no >>> example
    ' f(x:\n    """Twice x.\n    >>> f(2)\n    4\n    ',                         # not Python
    ' f(x):\n    y = 2\n    """Twice x.\n    >>> f(2)\n    4\n    ',             # code before the docstring
    ' f(x):\n    """A.\n    >>> f(1)\n    """\n\ndef g(y):\n    """B.\n    >>> g(1)\n    ',  # two functions
    '4th(x):\n    """Bad name.\n    >>> 4th(1)\n    ',                           # not an identifier
])
def test_parse_stub_rejects_what_is_not_one_documented_function(generated):
    assert ex.parse_stub(generated) is None


@pytest.mark.unit
def test_eval_leaks_catches_a_humaneval_name_or_line_and_passes_an_original():
    humaneval = [p.text for p in load_prompts("code", 164)]
    same_name = 'def has_close_elements(xs: list) -> bool:\n    """Anything.\n    >>> has_close_elements([])\n    False\n    """\n'
    line = next(s.strip() for s in humaneval[1].splitlines() if len(s.strip()) >= 30 and not s.strip().startswith("def"))
    line = line.strip('"').strip()  # as quoted differently in the stub below
    same_line = f'def totally_new(x: str) -> str:\n    """{line}\n    >>> totally_new("")\n    ""\n    """\n'
    assert ex.eval_leaks(same_name, humaneval)
    assert ex.eval_leaks(same_line, humaneval)
    assert not ex.eval_leaks(ex.parse_stub(GOOD), humaneval)
    assert not ex.eval_leaks("from typing import List, Tuple\n\n\n" + ex.parse_stub(GOOD).split("\n\n\n")[1], humaneval)
    assert not any(ex.eval_leaks(s, humaneval) for s in ex.FEW_SHOT.split("# Topic:")[1:])  # our own examples


@pytest.mark.integration
def test_write_exercises_caches_what_the_target_wrote_and_filters_it(tmp_path, tokenizer):
    cache = tmp_path / "exercises.json"
    raw = [GOOD, GOOD, " bad(", "", ' has_close_elements(x: list) -> bool:\n    """Hm.\n    >>> has_close_elements([])\n    ']
    cache.write_text(json.dumps({"seed": 0, "requests": 5, "raw": raw}))
    humaneval = [p.text for p in load_prompts("code", 164)]
    # The cache answers, so no model is needed; it is filtered again on every read.
    assert ex.write_exercises(None, tokenizer, 5, seed=0, cache=cache, eval_prompts=humaneval) == [ex.parse_stub(GOOD)]
    assert ex.write_exercises(None, tokenizer, 1, seed=0, cache=cache, eval_prompts=humaneval) == [ex.parse_stub(GOOD)]
    # Another seed, or more requests than cached, has the target write them (a tiny random model
    # writes nothing well-formed, so nothing is kept, but every request is recorded).
    model = tiny_qwen2(0).eval()
    model.config.max_position_embeddings = 2048  # the few-shot prompt is long in the test tokenizer
    assert ex.write_exercises(model, tokenizer, 2, seed=1, cache=cache, eval_prompts=humaneval, max_new_tokens=4) == []
    saved = json.loads(cache.read_text())
    assert saved["seed"] == 1 and saved["requests"] == 2 and len(saved["raw"]) == 2


@pytest.mark.unit
def test_target_exercises_are_the_code_on_policy_prompts(tmp_path, tokenizer):
    from training import train as tr

    cfg = load_config(TrainDraftConfig, None, ["data.on_policy=true", "data.on_policy_prompts=2", "data.code_prompts=target_exercises"])
    (tmp_path / "exercises.json").write_text(json.dumps({"seed": cfg.train.seed, "requests": 2, "raw": [GOOD, " bad("]}))
    prompts = tr.on_policy_prompts(cfg, tokenizer, [], None, tmp_path)
    assert [tokenizer.decode(p) for p in prompts] == [ex.parse_stub(GOOD)]
    with pytest.raises(ValueError, match="code_prompts='stubs' must be one of"):
        load_config(TrainDraftConfig, None, ["data.code_prompts=stubs"])
