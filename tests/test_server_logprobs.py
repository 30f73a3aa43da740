"""Issue 71's server side without a model: the sampling fields' parsing and their mapping onto
``SamplingParams``, the logprobs' response shapes (parsed by the official ``openai`` client's
types), token strings and bytes, and the processors reaching the request log and /metrics."""

from __future__ import annotations

import asyncio
import itertools
import json
from types import SimpleNamespace

import openai.types
import openai.types.chat
import pytest

from serving.engine import Request
from serving.engine.request import Completion, TokenLogprob
from serving.engine.sampling import SamplingParams
from serving.server.detokenize import token_texts
from serving.server.logprobs import TokenStrings, chat_logprobs, completion_logprobs, text_offsets
from serving.server.openai_api import APIError, ChatCompletionRequest, CompletionRequest, completion_body, parse_request
from tests.conftest import make_tokenizer

pytestmark = pytest.mark.unit

CHAT = b'"model": "m", "messages": [{"role": "user", "content": "x"}]'


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def test_every_field_maps_onto_sampling_params():
    body = parse_request(b'{"model": "m", "prompt": "x", "logprobs": 3, "logit_bias": {"15": -100, "3": 2.5}, '
                         b'"frequency_penalty": 0.5, "presence_penalty": -1, "min_p": 0.1, "repetition_penalty": 1.2}',
                         CompletionRequest)  # fmt: skip
    params = SamplingParams(**body.sampling_fields())
    assert params.logit_bias == ((3, 2.5), (15, -100.0))  # sorted (token id, bias) pairs
    assert (params.frequency_penalty, params.presence_penalty, params.min_p, params.repetition_penalty) == (0.5, -1.0, 0.1, 1.2)
    assert params.logprobs == 3
    assert params.processors == ("logit_bias", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p")
    # Nothing sent: the defaults, no processor, no logprobs.
    plain = SamplingParams(**parse_request(b'{"model": "m", "prompt": "x"}', CompletionRequest).sampling_fields())
    assert plain == SamplingParams() and plain.processors == ()
    # Chat: logprobs=true alone is the chosen token's logprob (0 alternatives); top_logprobs adds N.
    assert parse_request(b"{" + CHAT + b', "logprobs": true}', ChatCompletionRequest).sampling_fields()["logprobs"] == 0
    assert parse_request(b"{" + CHAT + b', "logprobs": true, "top_logprobs": 20}', ChatCompletionRequest).logprob_count == 20
    assert parse_request(b"{" + CHAT + b', "logprobs": false, "top_logprobs": 0}', ChatCompletionRequest).logprob_count is None


@pytest.mark.parametrize("cls,extra,param,says", [
    (CompletionRequest, b'"logprobs": 6', "logprobs", "[0, 5]"),
    (CompletionRequest, b'"logprobs": true', "logprobs", "integer"),
    (CompletionRequest, b'"top_logprobs": 2', "top_logprobs", "chat field"),
    (ChatCompletionRequest, b'"top_logprobs": 3', "top_logprobs", "logprobs=true"),
    (ChatCompletionRequest, b'"logprobs": true, "top_logprobs": 21', "top_logprobs", "[0, 20]"),
    (ChatCompletionRequest, b'"logprobs": 1', "logprobs", "boolean"),
    (CompletionRequest, b'"frequency_penalty": 2.5', "frequency_penalty", "[-2, 2]"),
    (ChatCompletionRequest, b'"presence_penalty": NaN', "presence_penalty", "[-2, 2]"),
    (CompletionRequest, b'"min_p": -0.1', "min_p", "[0, 1]"),
    (CompletionRequest, b'"repetition_penalty": 0', "repetition_penalty", "> 0"),
    (CompletionRequest, b'"repetition_penalty": 1e999', "repetition_penalty", "finite"),
    (CompletionRequest, b'"logit_bias": {"15": 101}', "logit_bias", "[-100, 100]"),
    (CompletionRequest, b'"logit_bias": {"-1": 5}', "logit_bias", "not a token id"),
    (ChatCompletionRequest, b'"logit_bias": {"ab": 5}', "logit_bias", "not a token id"),
    (CompletionRequest, b'"logit_bias": {"5": 1, "05": 2}', "logit_bias", "not a token id"),
    (CompletionRequest, b'"logit_bias": {"' + b"9" * 50 + b'": 5}', "logit_bias", "beyond any vocabulary"),
    (CompletionRequest, b'"logit_bias": {"5": "1"}', "logit_bias", "number"),
    (CompletionRequest, b'"logit_bias": [5]', "logit_bias", "dictionary"),
    (CompletionRequest, b'"echo": true', "echo", "echo"),
])  # fmt: skip
def test_out_of_range_sampling_fields_are_400s_naming_the_field(cls, extra, param, says):
    head = CHAT if cls is ChatCompletionRequest else b'"model": "m", "prompt": "x"'
    with pytest.raises(APIError) as info:
        parse_request(b"{" + head + b", " + extra + b"}", cls)
    assert info.value.status == 400 and info.value.param == param
    assert param in info.value.message and says in info.value.message


def test_token_strings_and_bytes(tok):
    strings = TokenStrings(tok)
    e_acute = tok.encode("é", add_special_tokens=False)
    assert len(e_acute) == 2  # two byte-level tokens, each a part of the character
    assert [strings(i)[0] for i in e_acute] == ["\ufffd", "\ufffd"]  # decoded alone, as vLLM shows them
    assert bytes(strings(e_acute[0])[1] + strings(e_acute[1])[1]).decode() == "é"  # the bytes join into it
    ascii_ids = tok.encode("def add", add_special_tokens=False)
    assert "".join(strings(i)[0] for i in ascii_ids) == "def add"
    assert all(bytes(strings(i)[1]) == strings(i)[0].encode() for i in ascii_ids)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert strings(eos) == ("<|im_end|>", list(b"<|im_end|>"))  # special tokens keep their text
    assert strings(len(tok) + 5) == ("", [])  # a model row beyond the tokenizer's entries


def test_response_shapes_parse_in_the_openai_client(tok):
    strings = TokenStrings(tok)
    ids = tok.encode("def add", add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")]
    entries = [TokenLogprob(t, -0.5 * n, ((t, -0.5 * n), (7, -2.0 - n), (9, float("-inf")))) for n, t in enumerate(ids)]
    done = Completion(ids, "def add", "stop", {}, logprobs=entries)

    chat = completion_body("chatcmpl-1", "m", done.text, "stop", {}, {}, True, chat_logprobs(done.logprobs, strings))
    json.dumps(chat, allow_nan=False)  # -inf became -9999.0: JSON has no infinity
    parsed = openai.types.chat.ChatCompletion.model_validate(chat | {"usage": None})
    content = parsed.choices[0].logprobs.content
    assert [c.token for c in content] == [tok.decode([t]) for t in ids] and content[-1].token == "<|im_end|>"
    assert content[1].logprob == -0.5 and [t.logprob for t in content[1].top_logprobs] == [-0.5, -3.0, -9999.0]
    assert content[1].top_logprobs[0].token == content[1].token and content[1].top_logprobs[1].bytes == strings(7)[1]

    texts = token_texts(tok, (), ids, done.text)
    assert "".join(texts) == "def add" and texts[-1] == ""  # the EOS releases no text
    body = completion_body("cmpl-1", "m", done.text, "stop", {}, {}, False,
                           completion_logprobs(done.logprobs, strings, text_offsets(texts)))  # fmt: skip
    lp = openai.types.Completion.model_validate(body | {"usage": None}).choices[0].logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids] and lp.token_logprobs == [-0.5 * n for n in range(len(ids))]
    assert lp.text_offset == text_offsets(texts) and lp.text_offset[0] == 0 and lp.text_offset[-1] == len("def add")
    # the chosen token first, then the N most likely: up to N + 1 entries (OpenAI's rule)
    assert list(lp.top_logprobs[1]) == [lp.tokens[1], strings(7)[0], strings(9)[0]]
    assert lp.top_logprobs[1][strings(9)[0]] == -9999.0
    # Not asked for: null, as before.
    assert completion_body("cmpl-2", "m", "x", "stop", {}, {}, False)["choices"][0]["logprobs"] is None


def test_text_offsets_follow_the_released_text_across_a_split_character_and_a_stop_string(tok):
    ids = tok.encode("aé b", add_special_tokens=False)
    texts = token_texts(tok, (), ids, "aé b")
    assert "".join(texts) == "aé b"
    split = [i for i, t in enumerate(texts) if t == ""]  # the first byte of é releases nothing
    assert split and texts[split[0] + 1].startswith("é")
    offsets = text_offsets(texts)
    assert offsets[split[0]] == offsets[split[0] + 1] == 1  # both start where é does
    cut = token_texts(tok, (" b",), ids, "aé")  # a stop string cut the text: the tokens are cut with it
    assert "".join(cut) == "aé" and len(cut) == len(ids)


def test_processors_reach_the_request_log_and_metrics():
    from serving.server.scheduler import Scheduler, Ticket

    logged = []
    log = SimpleNamespace(row=lambda **kw: kw, append=logged.append)
    choice = SimpleNamespace(draft="a", k=None, occupancy=1, fallback_floor=lambda ratio: 0.0, predicted_acceptance={},
                             expected_rate=0.0)  # fmt: skip
    router = SimpleNamespace(draft_names=["a"], collected_k=4, rate_at=lambda rate, k: rate, choose_batch=lambda texts, occ,
                             lengths=None: [choice] * len(texts))  # fmt: skip
    ids = itertools.count()
    engine = SimpleNamespace(config=SimpleNamespace(k=4, k_max=8), drafter_names=("a", "none"), num_running=0,
                             num_waiting=0, add_request=lambda request: next(ids))  # fmt: skip
    sched = Scheduler(engine, router, max_batch_size=8, queue_limit=8, request_log=log)
    loop = asyncio.new_event_loop()
    try:
        params = [SamplingParams(logit_bias=((5, -100.0),), min_p=0.1), SamplingParams(), SamplingParams(min_p=0.2)]
        tickets = [Ticket(Request([1, 2, 3], params=p), "text", loop) for p in params]
        sched._admit(tickets)
        for t in tickets:
            sched._finish(t, Completion([4], "x", "length", {"acceptance_rate": 0.0}), 0.0)
    finally:
        loop.close()
    assert [row["processors"] for row in logged] == [("logit_bias", "min_p"), (), ("min_p",)]
    counts = {s.labels["processor"]: s.value for fam in sched.metrics.registry.collect() for s in fam.samples
              if s.name == "choral_processor_requests_total"}  # fmt: skip
    assert counts == {"logit_bias": 1.0, "min_p": 2.0}
