"""Chat templates render exactly as Hugging Face renders them: ``transformers``' ``apply_chat_template`` is the
witness, on templates written for these tests in the style of the Llama 3.1, Qwen2.5, Mistral and Hermes tool
formats (tests/harness/chat_templates/), which use what HF's environment offers: ``{% break %}`` and
``{% continue %}``, ``tojson`` with its options, ``strftime_now``, ``raise_exception``, ``namespace``, macros,
``{% generation %}``, and the ``tools``, ``documents`` and ``add_generation_prompt`` variables."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenfleet_serving.engine.chat_template import ChatTemplateError, render_chat_template
from tokenfleet_serving.engine.tokenizer import load_tokenizer
from tokenfleet_serving.openai import protocol as P
from tokenfleet_serving.openai.errors import ApiError
from tokenfleet_serving.openai.prompt import prompt_token_ids

TEMPLATES = Path(__file__).resolve().parents[2] / "harness" / "chat_templates"
NAMES = ("llama3_json", "qwen25", "mistral", "hermes")

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city <by name> & country",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["c", "f"]}},
                       "required": ["city"]}}},
    {"type": "function", "function": {
        "name": "search", "description": "Search the web (résumés too)",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}},
                       "required": ["query"]}}},
]

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call00001", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Zürich\", \"unit\": \"c\"}"}}]},
    {"role": "tool", "tool_call_id": "call00001", "content": "{\"temp\": 21, \"sky\": \"<clear>\"}"},
    {"role": "assistant", "content": "21 degrees and clear."},
    {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "tomorrow?"}]},
]
DOCUMENTS = [{"title": "Alps", "text": "High & cold."}, {"title": "Lakes", "text": "Many."}]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """One tokenizer directory per template, as a checkpoint ships it (tokenizer.json + tokenizer_config.json)."""
    from tokenfleet_serving.testing_models import build_tokenizer

    tok = build_tokenizer(1024)
    dirs = {}
    for name in NAMES:
        d = tmp_path_factory.mktemp(name)
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
            "unk_token": "<unk>", "pad_token": "<unk>", "chat_template": (TEMPLATES / f"{name}.jinja").read_text()}))
        dirs[name] = d
    return dirs


def hf_render(directory: Path, messages, **kwargs) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(directory)).apply_chat_template(messages, tokenize=False, **kwargs)


def chat_body(messages, **extra) -> dict:
    return {"model": "m", "messages": messages, **extra}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("with_tools", [True, False])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_a_tool_conversation_renders_as_transformers_renders_it(checkpoints, name, with_tools, add_generation_prompt):
    extra = {"tools": TOOLS} if with_tools else {}
    if name == "hermes":
        extra["documents"] = DOCUMENTS
    req = P.parse_chat(chat_body(CONVERSATION, add_generation_prompt=add_generation_prompt, **extra))
    ours = load_tokenizer(checkpoints[name]).apply_chat_template(
        req.messages, add_generation_prompt=req.add_generation_prompt,
        tools=list(req.tools.tools) if req.tools else None, documents=req.documents)
    theirs = hf_render(checkpoints[name], req.messages, add_generation_prompt=add_generation_prompt,
                       tools=TOOLS if with_tools else None, documents=extra.get("documents"))
    assert ours == theirs
    # the decoded arguments, tool schemas and the tool result all reach the prompt
    assert "Zürich" in ours and "<clear>" in ours
    assert ("search" in ours) == with_tools
    if with_tools:
        assert "Current weather in a city <by name> & country" in ours      # tojson does not HTML-escape
        assert "résumés" in ours                                             # nor escape non-ASCII


@pytest.mark.parametrize("name", NAMES)
def test_the_server_path_tokenizes_that_rendering(checkpoints, name):
    tok = load_tokenizer(checkpoints[name])
    req = P.parse_chat(chat_body(CONVERSATION, tools=TOOLS))
    text = hf_render(checkpoints[name], req.messages, add_generation_prompt=True, tools=TOOLS)
    assert prompt_token_ids(tok, req, tok.vocab_size) == tok.encode(text, add_special_tokens=False)


def test_raise_exception_and_break_and_continue(checkpoints):
    """Mistral's refuses a bad tool call id with raise_exception, and stops at a developer message with break;
    Hermes skips system turns with continue. Both sides refuse the same way."""
    bad = [dict(m) for m in CONVERSATION]
    bad[2] = {**bad[2], "tool_calls": [{**bad[2]["tool_calls"][0], "id": "short"}]}
    req = P.parse_chat(chat_body(bad))
    tok = load_tokenizer(checkpoints["mistral"])
    with pytest.raises(ChatTemplateError, match="9 characters"):
        tok.apply_chat_template(req.messages)
    from jinja2 import TemplateError

    with pytest.raises(TemplateError, match="9 characters"):
        hf_render(checkpoints["mistral"], req.messages)
    with pytest.raises(ApiError) as err:
        prompt_token_ids(tok, req, tok.vocab_size)
    assert err.value.status == 400 and err.value.param == "messages" and "9 characters" in err.value.message


def test_template_kwargs_and_strftime_now(checkpoints):
    source = "{{ strftime_now('%Y') }}|{{ greeting }}|{% for i in range(5) %}{% if i == 2 %}{% break %}{% endif %}{{ i }}{% endfor %}"
    req = P.parse_chat(chat_body([{"role": "user", "content": "x"}], chat_template_kwargs={"greeting": "hi"}))
    from datetime import datetime

    out = render_chat_template(source, req.messages, **req.chat_template_kwargs)
    assert out == f"{datetime.now():%Y}|hi|01"
    from transformers.utils.chat_template_utils import render_jinja_template

    [theirs], _ = render_jinja_template([req.messages], chat_template=source, greeting="hi")
    assert out == theirs


def test_namespace_refuses_private_names_and_the_sandbox_holds():
    with pytest.raises(ChatTemplateError):
        render_chat_template("{% set ns = namespace(_x=1) %}{{ ns._x }}", [])
    with pytest.raises(ChatTemplateError):
        render_chat_template("{{ messages.__class__.__mro__ }}", [])
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat_template("{% for %}", [])


@pytest.mark.parametrize("body, param", [
    ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"documents": [{"title": 1}]}, "documents"),
    ({"add_generation_prompt": "yes"}, "add_generation_prompt"),
])
def test_template_inputs_are_checked(body, param):
    with pytest.raises(ApiError) as err:
        P.parse_chat(chat_body([{"role": "user", "content": "x"}], **body))
    assert err.value.status == 400 and err.value.param == param


def test_tool_call_arguments_nested_past_the_stack_are_a_400():
    deep = "[" * 100_000 + "]" * 100_000
    with pytest.raises(ApiError) as err:
        P.parse_chat(chat_body([{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}]}]))
    assert err.value.param == "messages[0].tool_calls[0].function.arguments"
