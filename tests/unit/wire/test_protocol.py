"""Request parsing and validation: a table of bad inputs, each naming its field."""
from __future__ import annotations

import pytest

from tokenfleet_serving.openai import protocol as P
from tokenfleet_serving.openai.errors import ApiError, error_body

LIMITS = P.Limits(max_model_len=512, max_prompt_tokens=400, max_tokens_limit=256, kv_capacity_tokens=1024)

GOOD = {"model": "m", "prompt": "hello"}
GOOD_CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}

BAD_COMPLETIONS = [
    ([1, 2], None, "body"),
    ("text", None, "body"),
    ({"prompt": "x"}, "model", "missing model"),
    ({"model": 3, "prompt": "x"}, "model", "model wrong type"),
    ({"model": "m"}, "prompt", "missing prompt"),
    ({"model": "m", "prompt": ""}, "prompt", "empty prompt"),
    ({"model": "m", "prompt": 42}, "prompt", "prompt wrong type"),
    ({"model": "m", "prompt": [1, "a"]}, "prompt", "mixed prompt list"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt", "batched prompts"),
    (dict(GOOD, max_tokens="10"), "max_tokens", "max_tokens string"),
    (dict(GOOD, max_tokens=0), "max_tokens", "max_tokens zero"),
    (dict(GOOD, max_tokens=1.5), "max_tokens", "max_tokens float"),
    (dict(GOOD, max_tokens=True), "max_tokens", "max_tokens bool"),
    (dict(GOOD, temperature=-1), "temperature", "negative temperature"),
    (dict(GOOD, temperature=1e9), "temperature", "absurd temperature"),
    (dict(GOOD, temperature="hot"), "temperature", "temperature string"),
    (dict(GOOD, top_p=0), "top_p", "top_p zero"),
    (dict(GOOD, top_p=1.5), "top_p", "top_p > 1"),
    (dict(GOOD, top_k=-5), "top_k", "top_k < -1"),
    (dict(GOOD, presence_penalty=3), "presence_penalty", "presence_penalty"),
    (dict(GOOD, frequency_penalty=-3), "frequency_penalty", "frequency_penalty"),
    (dict(GOOD, repetition_penalty=0), "repetition_penalty", "repetition_penalty"),
    (dict(GOOD, n=17), "n", "n over its bound"),
    (dict(GOOD, best_of=3), "best_of", "best_of"),
    (dict(GOOD, echo=True), "echo", "echo"),
    (dict(GOOD, suffix="x"), "suffix", "suffix"),
    (dict(GOOD, logprobs=21), "logprobs", "too many logprobs"),
    (dict(GOOD, logit_bias={"1": 500}), "logit_bias", "logit_bias outside [-100, 100]"),
    (dict(GOOD, stop=5), "stop", "stop wrong type"),
    (dict(GOOD, stop=[""]), "stop", "empty stop string"),
    (dict(GOOD, stop=["x"] * 17), "stop", "too many stops"),
    (dict(GOOD, stream="yes"), "stream", "stream string"),
    (dict(GOOD, stream_options={"include_usage": True}), "stream_options", "stream_options without stream"),
    (dict(GOOD, stream=True, stream_options={"bogus": 1}), "stream_options.bogus", "unknown stream option"),
    (dict(GOOD, stream=True, stream_options=[1]), "stream_options", "stream_options list"),
    (dict(GOOD, stop_token_ids=["a"]), "stop_token_ids", "stop_token_ids"),
    (dict(GOOD, frobnicate=1), "frobnicate", "unknown parameter"),
    (dict(GOOD, messages=[]), "messages", "chat field on completions"),
    (dict(GOOD, seed="1"), "seed", "seed string"),
    (dict(GOOD, temperature=float("nan")), "temperature", "nan"),
    (dict(GOOD, return_token_ids="yes"), "return_token_ids", "return_token_ids string"),
    (dict(GOOD, continuation=[1, 2]), "continuation", "continuation list"),
    (dict(GOOD, continuation={"output_token_ids": [1, "x"]}), "continuation.output_token_ids", "continuation ids"),
    (dict(GOOD, continuation={"output_token_ids": [1], "delivered_text": 5}), "continuation.delivered_text",
     "continuation text type"),
    (dict(GOOD, continuation={"output_token_ids": [], "delivered_text": "x"}), "continuation.delivered_text",
     "continuation text without tokens"),
    (dict(GOOD, continuation={"output_token_ids": [1], "from": "a"}), "continuation.from", "continuation extra"),
]


@pytest.mark.parametrize("body,param,case", BAD_COMPLETIONS, ids=[c[2] for c in BAD_COMPLETIONS])
def test_bad_completion_bodies_are_400_naming_the_field(body, param, case):
    with pytest.raises(ApiError) as err:
        P.parse_completion(body)
    assert err.value.status == 400
    assert err.value.param == param
    if param:
        assert param.split(".")[0] in err.value.message


BAD_CHAT = [
    ({"model": "m"}, "messages", "missing messages"),
    ({"model": "m", "messages": []}, "messages", "empty messages"),
    ({"model": "m", "messages": "hi"}, "messages", "messages string"),
    ({"model": "m", "messages": ["hi"]}, "messages[0]", "message not object"),
    ({"model": "m", "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role", "bad role"),
    ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content", "missing content"),
    ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0]", "image part"),
    (dict(GOOD_CHAT, top_logprobs=3), "top_logprobs", "top_logprobs without logprobs"),
    (dict(GOOD_CHAT, logprobs=True, top_logprobs=99), "top_logprobs", "too many top_logprobs"),
    (dict(GOOD_CHAT, max_completion_tokens=-1), "max_completion_tokens", "negative max_completion_tokens"),
    (dict(GOOD_CHAT, prompt="x"), "prompt", "completion field on chat"),
    (dict(GOOD_CHAT, tools=[{"type": "function"}]), "tools[0].function", "tool without a function"),
]


@pytest.mark.parametrize("body,param,case", BAD_CHAT, ids=[c[2] for c in BAD_CHAT])
def test_bad_chat_bodies_are_400_naming_the_field(body, param, case):
    with pytest.raises(ApiError) as err:
        P.parse_chat(body)
    assert (err.value.status, err.value.param) == (400, param)


def test_completion_parsing_keeps_every_sampling_field():
    req = P.parse_completion({"model": "m", "prompt": ["hello"], "max_tokens": 7, "temperature": 0, "top_p": 0.9,
                              "top_k": 5, "min_p": 0.1, "seed": 3, "stop": "x", "stop_token_ids": [4],
                              "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                              "logprobs": 2, "n": 1, "user": "u"})
    assert (req.kind, req.prompt_text, req.max_tokens, req.stream, req.include_usage, req.logprobs) == \
        ("completion", "hello", 7, True, True, 2)
    assert req.sampling == {"temperature": 0.0, "top_p": 0.9, "top_k": 5, "min_p": 0.1, "seed": 3, "stop": ("x",),
                            "stop_token_ids": (4,), "ignore_eos": True}
    params = P.sampling_params(req, req.max_tokens)
    assert (params.max_tokens, params.greedy, params.stop, params.logprobs) == (7, True, ("x",), 2)


def test_completion_accepts_token_id_prompts_and_defaults_to_16_tokens():
    for prompt in ([5, 6, 7], [[5, 6, 7]]):
        req = P.parse_completion({"model": "m", "prompt": prompt})
        assert (req.prompt_token_ids, req.prompt_text, req.max_tokens) == ([5, 6, 7], None, 16)


def test_chat_normalizes_text_parts_and_prefers_max_completion_tokens():
    req = P.parse_chat({"model": "m", "max_tokens": 9, "max_completion_tokens": 4, "logprobs": True,
                        "messages": [{"role": "system", "content": "be brief"},
                                     {"role": "user", "content": [{"type": "text", "text": "a"},
                                                                  {"type": "text", "text": "b"}]},
                                     {"role": "assistant", "content": None}]})
    assert req.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
                            {"role": "assistant", "content": ""}]
    assert (req.max_tokens, req.logprobs) == (4, 0)
    assert P.parse_chat(GOOD_CHAT).max_tokens is None


@pytest.mark.parametrize("kind,prompt_len,max_tokens,expect", [
    ("completion", 10, 16, 16),
    ("chat", 10, None, 256),                 # fills the context, capped by the server limit
    ("chat", 400, None, 112),                # 512 - 400
    ("completion", 401, 1, "prompt"),        # over max_prompt_tokens
    ("completion", 300, 257, "max_tokens"),  # over max_tokens_limit
    ("completion", 300, 250, "max_tokens"),  # 300 + 250 > 512
    ("completion", 256, 256, 256),           # exactly the context
])
def test_resolve_max_tokens(kind, prompt_len, max_tokens, expect):
    req = P.GenerationRequest(kind, "m", "x", None, None, False, False, max_tokens)
    if isinstance(expect, int):
        assert P.resolve_max_tokens(req, prompt_len, LIMITS) == expect
    else:
        with pytest.raises(ApiError) as err:
            P.resolve_max_tokens(req, prompt_len, LIMITS)
        assert (err.value.status, err.value.param) == (400, expect)


def test_kv_capacity_bounds_the_context():
    small = P.Limits(max_model_len=512, max_prompt_tokens=511, max_tokens_limit=512, kv_capacity_tokens=64)
    req = P.GenerationRequest("chat", "m", None, None, [], False, False, None)
    assert P.resolve_max_tokens(req, 60, small) == 4
    with pytest.raises(ApiError):
        P.resolve_max_tokens(req, 64, small)


def test_error_body_is_openai_shaped():
    assert ApiError(429, "busy", headers={"Retry-After": "1"}).body() == {
        "error": {"message": "busy", "type": "rate_limit_error", "param": None, "code": 429}}
    assert error_body(404, "no", "model")["error"]["param"] == "model"


def test_logprob_formats():
    toks = [P.TokenInfo("ab", -0.5, [("ab", -0.5), ("c", -1.0)]), P.TokenInfo("d", -0.1, [])]
    comp = P.completion_logprobs(toks)
    assert comp == {"tokens": ["ab", "d"], "token_logprobs": [-0.5, -0.1],
                    "top_logprobs": [{"ab": -0.5, "c": -1.0}, {}], "text_offset": [0, 2]}
    chat = P.chat_logprobs(toks)["content"]
    assert chat[0]["bytes"] == [97, 98] and chat[0]["top_logprobs"][1] == {"token": "c", "logprob": -1.0,
                                                                          "bytes": [99]}


def test_usage_carries_cached_tokens():
    assert P.usage(10, 3, 8) == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                                 "prompt_tokens_details": {"cached_tokens": 8}}


# ---- any JSON at all: a request or a 400, never a crash ----------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=8)
_json = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                     | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
_fields = sorted(P.COMPLETION_FIELDS | P.CHAT_FIELDS)
_overrides = st.dictionaries(st.sampled_from(_fields), _json, max_size=3)
_bodies = st.dictionaries(st.sampled_from(_fields), _json, max_size=8) | _json


@settings(max_examples=400, deadline=None)
@given(body=_bodies, overrides=_overrides, chat=st.booleans(), from_valid=st.booleans())
def test_any_json_is_a_request_or_a_400(body, overrides, chat, from_valid):
    if from_valid:        # a valid request with a few fields replaced by arbitrary JSON
        body = dict(GOOD_CHAT if chat else GOOD, **overrides)
    try:
        req = (P.parse_chat if chat else P.parse_completion)(body)
    except ApiError as e:
        assert e.status == 400 and e.message
        return
    try:
        n = 10
        P.sampling_params(req, P.resolve_max_tokens(req, n, LIMITS))
    except ApiError as e:
        assert e.status == 400 and e.message


# ---- the body as bytes: everything later steps cannot handle is a 400 (issue 19) --------------------------

def _raw(obj) -> bytes:
    import json
    return json.dumps(obj).encode()


def _nested(levels: int) -> list:
    out: list = []
    for _ in range(levels - 1):
        out = [out]
    return out


BAD_BODIES = [
    (b'{"model": "m", "prompt": "\\ud800"}', "prompt", "lone surrogate in the prompt"),
    (b'{"model": "m", "prompt": "ok \\udfff ok"}', "prompt", "lone low surrogate"),
    (b'{"model": "m", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages[0].content",
     "lone surrogate in a chat message"),
    (b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udbff"}]}]}',
     "messages[0].content[0].text", "lone surrogate in a text part"),
    (b'{"model": "m", "prompt": "x", "stop": ["\\ud800"]}', "stop[0]", "lone surrogate in a stop string"),
    (b'{"model": "m", "prompt": "x", "stop": "\\ud800"}', "stop", "lone surrogate as the stop string"),
    (b'{"model": "\\ud800", "prompt": "x"}', "model", "lone surrogate in the model"),
    (b'{"\\ud800": 1}', None, "lone surrogate in a key"),
    (b"[" * 5000 + b"]" * 5000, None, "nested 5,000 deep"),
    (b'{"a": ' + b"[" * 65 + b"]" * 65 + b"}", None, "nested 66 deep"),
    (b'{"model": "m", "prompt": "x", "max_tokens": ' + b"9" * 4301 + b"}", None, "an integer of 4,301 digits"),
    (b'{"model": "m", "prompt": "x", "seed": -' + b"9" * 5000 + b"}", None, "a negative integer of 5,000 digits"),
    (b'{"model": "m", "prompt": "x", "temperature": NaN}', None, "NaN"),
    (b'{"model": "m", "prompt": "x", "temperature": -Infinity}', None, "-Infinity"),
    (b"\xff\xfe{}", None, "not UTF-8"),
    (b'{"model": "m", "prompt": "x"', None, "truncated"),
    (b"", None, "empty"),
]


@pytest.mark.parametrize("raw,param,case", BAD_BODIES, ids=[c[2] for c in BAD_BODIES])
def test_bodies_no_later_step_could_handle_are_400(raw, param, case):
    with pytest.raises(ApiError) as err:
        P.parse_json_body(raw)
    assert err.value.status == 400 and err.value.param == param and err.value.message


@pytest.mark.parametrize("obj", [
    {"model": "m", "prompt": "emoji \U0001F600 and \\ud800 as text", "stop": ["\u00e9"]},
    {"a": "[[[[[[[[[[" * 20, "b": "{{{{" * 50},                    # brackets inside strings do not nest
    {"a": _nested(63)},                                          # 64 levels with the object
    {"max_tokens": int("9" * 4300)},
])
def test_valid_bodies_parse(obj):
    assert P.parse_json_body(_raw(obj)) == obj
    assert P.parse_json_body(_raw(obj).decode().encode("utf-8")) == obj


def test_escaped_surrogate_pairs_are_one_character():
    assert P.parse_json_body(b'{"p": "\\ud83d\\ude00"}') == {"p": "\U0001F600"}


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("value", [1e-300, 1e-45, 0.0])
def test_repetition_penalties_the_sampler_cannot_compute_are_400_naming_it(chat, value):
    body = dict(GOOD_CHAT if chat else GOOD, repetition_penalty=value)
    with pytest.raises(ApiError) as err:
        (P.parse_chat if chat else P.parse_completion)(body)
    assert err.value.status == 400 and err.value.param == "repetition_penalty"


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("value", [1e-300, 5e-324, 1e-45])
def test_tiny_temperatures_are_accepted(chat, value):
    req = (P.parse_chat if chat else P.parse_completion)(dict(GOOD_CHAT if chat else GOOD, temperature=value))
    assert P.sampling_params(req, 4).temperature == value


def test_token_ids_and_a_continuation_parse_for_both_endpoints():
    for parse, good in ((P.parse_completion, GOOD), (P.parse_chat, GOOD_CHAT)):
        req = parse(dict(good, return_token_ids=True,
                         continuation={"output_token_ids": [4, 5], "delivered_text": "ab"}))
        assert req.return_token_ids
        assert req.continuation.output_token_ids == (4, 5) and req.continuation.delivered_text == "ab"
        plain = parse(good)
        assert not plain.return_token_ids and plain.continuation is None
