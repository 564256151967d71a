"""The OpenAI-compatible wire protocol: parse and validate requests, shape responses.

Pure functions over decoded JSON: no I/O, no engine. The server and the router
both read requests with these functions, so they agree on what a request says.
Every rejection is an :class:`~tokenfleet_serving.openai.errors.ApiError` that
names the offending field.
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any

from tokenfleet_serving.engine.continuation import Continuation
from tokenfleet_serving.engine.sampling_params import MIN_REPETITION_PENALTY, SamplingParams

from . import sampling_fields
from .errors import ApiError, bad
from .tools import ToolChoice, parse_tools, tool_call_output

# ---- the body: bytes -> JSON, within bounds every later step can handle ---------------

MAX_JSON_DEPTH = 64          # an OpenAI request nests 4 levels (messages[i].content[j].text)
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON value")


def _json_depth(raw: bytes) -> int:
    """Deepest nesting of a body that is valid JSON (strings, which may hold brackets, are skipped)."""
    import numpy as np

    brackets = np.frombuffer(_JSON_STRING.sub(b"", raw).translate(None, _NOT_BRACKETS), dtype=np.uint8)
    if not brackets.size:
        return 0
    steps = np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1)
    return int(steps.cumsum().max())


def _has_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _lone_surrogate(obj: Any) -> str | None:
    """Where the first string (a value, or a key) holding a lone UTF-16 surrogate is, else None."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str) and _has_surrogate(value):
            return f"'{path}'" if path else "the body"
        if isinstance(value, dict):
            for k, v in value.items():
                if _has_surrogate(k):
                    return f"a key of '{path}'" if path else "a key of the body"
                stack.append((v, f"{path}.{k}" if path else k))
        elif isinstance(value, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(value))
    return None


def parse_json_body(raw: bytes) -> Any:
    """The request body as JSON, or a 400 for anything later steps could not handle.

    Refused: bytes that are not UTF-8, text that is not JSON (``NaN`` and
    ``Infinity`` included), integers beyond Python's 4,300-digit limit, nesting
    deeper than ``MAX_JSON_DEPTH``, and strings with a lone UTF-16 surrogate
    (``"\\ud800"``), which no tokenizer can encode.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"request body is not valid UTF-8: {e}") from e
    try:
        body = json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:      # JSONDecodeError, an integer over the digit limit, NaN/Infinity
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH and _json_depth(raw) > MAX_JSON_DEPTH:
        raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels")
    if _SURROGATE_ESCAPE.search(raw):
        where = _lone_surrogate(body)
        if where is not None:
            param = where[1:-1] if where.startswith("'") else None
            raise ApiError(400, f"{where} contains a lone UTF-16 surrogate (such as \\ud800); "
                                "send valid Unicode text", param)
    return body


@dataclass(frozen=True)
class Limits:
    """Server-side bounds a request must fit in (configured at startup)."""
    max_model_len: int                 # context length: prompt + output tokens
    max_prompt_tokens: int             # <= max_model_len - 1
    max_tokens_limit: int              # largest max_tokens a client may ask for
    kv_capacity_tokens: int            # tokens the whole KV pool holds; one request must fit


# ---- typed field readers -----------------------------------------------------

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad(name, f"must be an integer, got {type(v).__name__}")
    if lo is not None and v < lo or hi is not None and v > hi:
        raise bad(name, f"must be in [{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}], got {v}")
    return v


def _float(body: dict, name: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(name)
    if v is None:
        return None
    if not _is_number(v):
        raise bad(name, f"must be a finite number, got {v!r}")
    if v < lo or v > hi or (lo_open and v == lo):
        raise bad(name, f"must be in {'(' if lo_open else '['}{lo}, {hi}], got {v}")
    return float(v)


def _bool(body: dict, name: str) -> bool | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise bad(name, f"must be a boolean, got {type(v).__name__}")
    return v


def _stream_option(opts: dict, name: str) -> bool | None:
    """A boolean of ``stream_options``; anything else (``"true"``, ``1``) is a 400 naming it."""
    v = opts.get(name)
    if v is not None and not isinstance(v, bool):
        raise bad(f"stream_options.{name}", f"must be a boolean, got {type(v).__name__}")
    return v


def _string(body: dict, name: str) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise bad(name, f"must be a string, got {type(v).__name__}")
    return v


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    if isinstance(v, str):
        v = [v]
    if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
        raise bad("stop", "must be a string or a list of strings")
    if len(v) > 16:
        raise bad("stop", f"allows at most 16 sequences, got {len(v)}")
    if any(not s for s in v):
        raise bad("stop", "must not contain empty strings")
    return tuple(v)


def _token_list(v: Any, name: str) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(t) for t in v):
        raise bad(name, "must be a list of integer token ids")
    return v


# ---- requests ---------------------------------------------------------------

# Fields accepted by both endpoints. OpenAI fields we do not act on are listed
# with the only value we accept; anything else outside these sets is an error.
_SAMPLING_FIELDS = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop",
                    "seed", "presence_penalty", "frequency_penalty", "user", "logit_bias",
                    # vLLM extras (extra_body in the openai client)
                    "top_k", "min_p", "repetition_penalty", "ignore_eos", "stop_token_ids",
                    "include_stop_str_in_output", "skip_special_tokens", "min_tokens", "structured_outputs",
                    # tokenfleet extensions: token ids in the response (vLLM's name), and continuing a request
                    # another replica started (the router's stream migration)
                    "return_token_ids", "continuation"}
COMPLETION_FIELDS = _SAMPLING_FIELDS | {"prompt", "logprobs", "echo", "suffix", "best_of"}
CHAT_FIELDS = _SAMPLING_FIELDS | {"messages", "logprobs", "top_logprobs", "max_completion_tokens", "response_format",
                                  "tools", "tool_choice", "parallel_tool_calls",
                                  # vLLM's chat-template extras
                                  "documents", "add_generation_prompt", "chat_template_kwargs"}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class GenerationRequest:
    """A validated request, ready to tokenize and hand to the engine."""
    kind: str                          # "completion" or "chat"
    model: str
    prompt_text: str | None            # completions: text prompt
    prompt_token_ids: list[int] | None  # completions: pre-tokenized prompt
    messages: list[dict] | None        # chat: normalized messages
    stream: bool
    include_usage: bool
    max_tokens: int | None             # None: fill the context (chat) -- resolved by resolve_max_tokens
    sampling: dict = field(default_factory=dict)   # SamplingParams kwargs except max_tokens
    logprobs: int | None = None        # top-N alternatives; None: no logprobs
    return_token_ids: bool = False     # each choice (and streamed chunk) carries its output token ids
    continuation: Continuation | None = None   # output already delivered by another replica (engine/continuation.py)
    n: int = 1                         # choices, each an engine request sharing the prompt's KV
    continuous_usage_stats: bool = False   # stream_options: usage in every streamed chunk
    tools: ToolChoice | None = None    # chat: tools, tool_choice and parallel_tool_calls (tools.py)
    documents: list[dict] | None = None        # chat: retrieval documents, passed to the chat template
    add_generation_prompt: bool = True         # chat: end the prompt with the assistant turn's header
    chat_template_kwargs: dict = field(default_factory=dict)   # chat: more variables for the chat template


def _check_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(unknown[0], "is not a supported parameter")


def _common(body: dict) -> tuple[str, bool, bool, dict]:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "is required and must be a non-empty string")
    stream = bool(_bool(body, "stream"))
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise bad("stream_options", "must be an object")
        if not stream:
            raise bad("stream_options", "is only allowed when 'stream' is true")
        extra = sorted(set(opts) - {"include_usage", "continuous_usage_stats"})
        if extra:
            raise bad(f"stream_options.{extra[0]}", "is not a supported parameter")
        include_usage = bool(_stream_option(opts, "include_usage"))
        _stream_option(opts, "continuous_usage_stats")
    bias = sampling_fields.logit_bias(body)
    if body.get("user") is not None:
        _string(body, "user")
    sampling: dict[str, Any] = {}
    if bias:
        sampling["logit_bias"] = bias
    for name, value in (("min_tokens", sampling_fields.min_tokens(body)), ("structured", sampling_fields.structured(body))):
        if value is not None:
            sampling[name] = value
    for name, lo, hi, lo_open in (("temperature", 0.0, 2.0, False), ("top_p", 0.0, 1.0, True),
                                  ("min_p", 0.0, 1.0, False), ("presence_penalty", -2.0, 2.0, False),
                                  ("frequency_penalty", -2.0, 2.0, False),
                                  ("repetition_penalty", MIN_REPETITION_PENALTY, 2.0, False)):
        v = _float(body, name, lo, hi, lo_open)
        if v is not None:
            sampling[name] = v
    top_k = _int(body, "top_k", -1, 1_000_000)
    if top_k is not None:
        sampling["top_k"] = top_k
    seed = _int(body, "seed", -(2**63), 2**63 - 1)
    if seed is not None:
        sampling["seed"] = seed
    stop = _stop(body)
    if stop:
        sampling["stop"] = stop
    if body.get("stop_token_ids") is not None:
        sampling["stop_token_ids"] = tuple(_token_list(body["stop_token_ids"], "stop_token_ids"))
    for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
        v = _bool(body, name)
        if v is not None:
            sampling[name] = v
    return model, stream, include_usage, sampling


MAX_CONTINUATION_TEXT = 4 * 2**20


def _extensions(body: dict) -> tuple[bool, Continuation | None]:
    """``return_token_ids`` and ``continuation`` (``{"output_token_ids": [...], "delivered_text": "..."}``)."""
    return_ids = bool(_bool(body, "return_token_ids"))
    cont = body.get("continuation")
    if cont is None:
        return return_ids, None
    if not isinstance(cont, dict):
        raise bad("continuation", "must be an object {\"output_token_ids\": [...], \"delivered_text\": \"...\"}")
    extra = sorted(set(cont) - {"output_token_ids", "delivered_text"})
    if extra:
        raise bad(f"continuation.{extra[0]}", "is not a supported parameter")
    ids = cont.get("output_token_ids")
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise bad("continuation.output_token_ids", "must be a list of integer token ids")
    text = cont.get("delivered_text", "")
    if not isinstance(text, str) or len(text) > MAX_CONTINUATION_TEXT:
        raise bad("continuation.delivered_text", "must be a string (the output text the client received)")
    if text and not ids:
        raise bad("continuation.delivered_text", "needs the output_token_ids it was decoded from")
    return return_ids, Continuation(tuple(ids), text)


def parse_completion(body: Any) -> GenerationRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    _check_fields(body, COMPLETION_FIELDS)
    model, stream, include_usage, sampling = _common(body)
    prompt = body.get("prompt")
    # one prompt per request: a string, a token list, or a one-element list of either
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    text, ids = None, None
    if isinstance(prompt, str):
        if not prompt:
            raise bad("prompt", "must not be empty")
        text = prompt
    elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        ids = prompt
    elif isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", "must be a single prompt; send one request per prompt")
    else:
        raise bad("prompt", "is required: a non-empty string or a list of token ids")
    if body.get("echo"):
        raise bad("echo", "is not supported")
    if body.get("suffix") is not None:
        raise bad("suffix", "is not supported")
    best_of = _int(body, "best_of", 1)
    if best_of not in (None, 1):
        raise bad("best_of", f"is not supported: must be 1 (ask for n choices instead), got {best_of}")
    logprobs = _int(body, "logprobs", 0, 20)
    max_tokens = _int(body, "max_tokens", 1)
    req = GenerationRequest("completion", model, text, ids, None, stream, include_usage,
                            16 if max_tokens is None else max_tokens, sampling, logprobs, *_extensions(body))
    return _with_choices(req, body)


def _with_choices(req: GenerationRequest, body: dict) -> GenerationRequest:
    req.n = sampling_fields.choices(body)
    req.continuous_usage_stats = sampling_fields.continuous_usage_stats(body, req.stream)
    if req.n > 1 and req.continuation is not None:
        raise bad("n", "must be 1 when continuing a request (continuation)")
    return req


def _message_content(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}.content[{i}]", "must be a text part {\"type\": \"text\", \"text\": ...}")
            parts.append(part["text"])
        return "".join(parts)
    raise bad(f"{where}.content", "must be a string or a list of text parts")


def _tool_calls(calls: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls``, with each call's ``arguments`` (a JSON string on the wire) as the
    object it encodes, which is what chat templates render (as vLLM and Hugging Face give it to them)."""
    if not isinstance(calls, list):
        raise bad(f"{where}.tool_calls", "must be a list of tool calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad(at, "must be {\"id\": ..., \"type\": \"function\", \"function\": {\"name\": ..., "
                          "\"arguments\": \"{...}\"}}")
        if call.get("type", "function") != "function":
            raise bad(f"{at}.type", f"must be \"function\", got {call.get('type')!r}")
        if not isinstance(call.get("id"), str):
            raise bad(f"{at}.id", "is required and must be a string")
        arguments = fn.get("arguments", "{}")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments or "{}")
            except (ValueError, RecursionError):
                raise bad(f"{at}.function.arguments", "must be a JSON object encoded as a string") from None
        if not isinstance(arguments, dict):
            raise bad(f"{at}.function.arguments", "must encode a JSON object")
        out.append({"id": call["id"], "type": "function", "function": {"name": fn["name"], "arguments": arguments}})
    return out


def normalize_messages(messages: Any) -> list[dict]:
    """Chat messages as the chat template sees them: ``{"role", "content": str}``, plus ``name``, an assistant's
    ``tool_calls`` (arguments decoded) and a tool result's ``tool_call_id``."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "is required and must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(where, "must be an object")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        msg: dict[str, Any] = {"role": role, "content": _message_content(content, where)}
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise bad(f"{where}.tool_calls", "is only allowed in assistant messages")
            if m["tool_calls"]:
                msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise bad(f"{where}.tool_call_id", "is required in a tool message and must be a string")
            msg["tool_call_id"] = m["tool_call_id"]
        out.append(msg)
    return out


def _template_inputs(body: dict) -> tuple[list[dict] | None, bool, dict]:
    """``documents``, ``add_generation_prompt`` and ``chat_template_kwargs``, for the chat template."""
    documents = body.get("documents")
    if documents is not None:
        if not isinstance(documents, list) or not all(
                isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in d.items())
                for d in documents):
            raise bad("documents", "must be a list of objects of strings, such as {\"title\": ..., \"text\": ...}")
    add = _bool(body, "add_generation_prompt")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad("chat_template_kwargs", "must be an object")
    taken = sorted(set(kwargs) & TEMPLATE_VARIABLES)
    if taken:
        raise bad(f"chat_template_kwargs.{taken[0]}", "is set by the server; use the request field of that name")
    return documents, add is not False, kwargs


# what the server gives a chat template itself; chat_template_kwargs may add variables, not replace these
TEMPLATE_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt", "bos_token", "eos_token",
                                "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"})


def parse_chat(body: Any) -> GenerationRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS)
    model, stream, include_usage, sampling = _common(body)
    messages = normalize_messages(body.get("messages"))
    max_tokens = _int(body, "max_completion_tokens", 1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", 1)
    want_logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, 20)
    if top is not None and not want_logprobs:
        raise bad("top_logprobs", "requires 'logprobs' to be true")
    logprobs = (top or 0) if want_logprobs else None
    tools = parse_tools(body)
    if tools is not None and tools.constrained:
        if "structured" in sampling:
            raise bad("tool_choice", f"{tools.mode!r} constrains the output to tool calls, which cannot be combined "
                                     "with response_format or structured_outputs")
        sampling["structured"] = tool_call_output(tools)
    documents, add_generation_prompt, template_kwargs = _template_inputs(body)
    req = GenerationRequest("chat", model, None, None, messages, stream, include_usage,
                            max_tokens, sampling, logprobs, *_extensions(body), tools=tools, documents=documents,
                            add_generation_prompt=add_generation_prompt, chat_template_kwargs=template_kwargs)
    return _with_choices(req, body)


def resolve_max_tokens(req: GenerationRequest, num_prompt_tokens: int, limits: Limits) -> int:
    """Check the prompt against the limits and settle max_tokens (OpenAI: prompt + output <= context)."""
    if num_prompt_tokens > limits.max_prompt_tokens:
        raise ApiError(400, f"prompt has {num_prompt_tokens} tokens; this server accepts at most "
                            f"{limits.max_prompt_tokens} prompt tokens", "messages" if req.kind == "chat" else "prompt")
    room = min(limits.max_model_len, limits.kv_capacity_tokens) - num_prompt_tokens
    if room < 1:
        raise ApiError(400, f"prompt has {num_prompt_tokens} tokens, leaving no room for output in this "
                            f"model's context of {min(limits.max_model_len, limits.kv_capacity_tokens)} tokens",
                       "messages" if req.kind == "chat" else "prompt")
    name = "max_tokens"
    if req.max_tokens is None:
        return min(room, limits.max_tokens_limit)
    if req.max_tokens > limits.max_tokens_limit:
        raise bad(name, f"must be <= {limits.max_tokens_limit} on this server, got {req.max_tokens}")
    if req.max_tokens > room:
        raise ApiError(400, f"this model's maximum context length is {limits.max_model_len} tokens "
                            f"(KV cache {limits.kv_capacity_tokens}); you requested {num_prompt_tokens + req.max_tokens} "
                            f"tokens ({num_prompt_tokens} in the prompt, {req.max_tokens} for the completion)", name)
    return req.max_tokens


def sampling_params(req: GenerationRequest, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, logprobs=req.logprobs, **req.sampling)
    except ValueError as e:   # the engine's own checks, already field-named
        raise ApiError(400, str(e), named_param(str(e))) from e


def named_param(engine_message: str) -> str | None:
    """The field an engine refusal names ("sampling parameter 'x' ..."), for the error's ``param``."""
    named = re.search(r"sampling parameter '(\w+)'", engine_message)
    return named.group(1) if named else None


# ---- responses --------------------------------------------------------------

def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class TokenInfo:
    """One generated token with its logprob and top alternatives, as text."""
    token: str
    logprob: float
    top: list[tuple[str, float]]


def completion_logprobs(tokens: list[TokenInfo], text_offset_start: int = 0) -> dict:
    offsets, pos = [], text_offset_start
    for t in tokens:
        offsets.append(pos)
        pos += len(t.token)
    return {"tokens": [t.token for t in tokens], "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [{tok: lp for tok, lp in t.top} for t in tokens], "text_offset": offsets}


def chat_logprobs(tokens: list[TokenInfo]) -> dict:
    def entry(tok: str, lp: float) -> dict:
        return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}
    return {"content": [dict(entry(t.token, t.logprob), top_logprobs=[entry(a, b) for a, b in t.top])
                        for t in tokens]}


def completion_chunk(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                     logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish_reason: str | None,
               logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, model: str, created: int, kind: str, usage_body: dict) -> dict:
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_body}


def completion_response(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                        usage_body: dict, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage_body}


def chat_response(rid: str, model: str, created: int, text: str, finish_reason: str | None,
                  usage_body: dict, logprobs: dict | None = None) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                         "logprobs": logprobs, "finish_reason": finish_reason}],
            "usage": usage_body}


def models_response(names: list[str], created: int, max_model_len: int) -> dict:
    return {"object": "list", "data": [{"id": n, "object": "model", "created": created, "owned_by": "tokenfleet",
                                        "max_model_len": max_model_len} for n in names]}


def now() -> int:
    return int(time.time())
