"""Tool calling in a chat request: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` read and checked, and the
JSON schema that constrains the output when a call is required.

- ``tools``: a list of ``{"type": "function", "function": {"name", "description"?, "parameters"?, "strict"?}}``.
  A name is 1-64 characters of ``[a-zA-Z0-9_-]`` and unique; ``parameters`` is a JSON schema (checked against
  the JSON Schema 2020-12 meta-schema); absent, the function takes no arguments.
- ``tool_choice``: ``"none"`` (answer in words), ``"auto"`` (the model decides; the server's tool-call parser
  reads calls out of the text), ``"required"`` (one or more calls), or ``{"type": "function", "function":
  {"name": N}}`` (exactly one call of N). Default: ``"auto"`` with tools, ``"none"`` without.
- ``parallel_tool_calls``: false allows at most one call per answer (default true).

With ``required`` or a named function the model's output is constrained to the JSON that
:func:`tool_call_schema` describes, so it always parses into calls with valid arguments.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from tokenfleet_serving.engine.structured.spec import StructuredOutputError, StructuredOutputSpec

from .errors import bad

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
MAX_TOOLS = 128
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}

AUTO, NONE, REQUIRED, NAMED = "auto", "none", "required", "function"


@dataclass(frozen=True)
class ToolChoice:
    """The tools of a request and what it lets the model do with them."""
    tools: tuple[dict, ...]          # as sent (validated): what the chat template shows the model
    mode: str                        # AUTO, NONE, REQUIRED or NAMED
    function: str | None = None      # NAMED: the function to call
    parallel: bool = True            # more than one call per answer

    @property
    def constrained(self) -> bool:
        """The output must be calls (REQUIRED, NAMED): decoding is constrained to tool_call_schema()."""
        return self.mode in (REQUIRED, NAMED)

    def parameters(self, name: str) -> dict:
        for tool in self.tools:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters") or NO_ARGUMENTS
        raise KeyError(name)


def _check_schema(schema: Any, where: str) -> None:
    if not isinstance(schema, dict):
        raise bad(where, "must be a JSON schema object")
    import jsonschema

    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        path = "".join(f"[{p!r}]" if isinstance(p, int) else f".{p}" for p in e.absolute_path)
        raise bad(where, f"is not a valid JSON schema: {e.message} (at {path or 'the top'})") from None
    except (RecursionError, ValueError, TypeError) as e:       # a schema the validator itself chokes on
        raise bad(where, f"is not a valid JSON schema: {type(e).__name__}") from None


def _tool(tool: Any, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise bad(where, "must be an object {\"type\": \"function\", \"function\": {...}}")
    extra = sorted(set(tool) - {"type", "function"})
    if extra:
        raise bad(f"{where}.{extra[0]}", "is not a supported parameter")
    if tool.get("type") != "function":
        raise bad(f"{where}.type", f"must be \"function\", got {tool.get('type')!r}")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise bad(f"{where}.function", "must be an object with a 'name'")
    extra = sorted(set(fn) - {"name", "description", "parameters", "strict"})
    if extra:
        raise bad(f"{where}.function.{extra[0]}", "is not a supported parameter")
    name = fn.get("name")
    if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
        raise bad(f"{where}.function.name", f"must be 1-64 characters of a-z, A-Z, 0-9, _ and -, got {name!r}")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise bad(f"{where}.function.description", "must be a string")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise bad(f"{where}.function.strict", "must be a boolean")
    if fn.get("parameters") is not None:
        _check_schema(fn["parameters"], f"{where}.function.parameters")
    return tool


def parse_tools(body: dict) -> ToolChoice | None:
    """The request's tools and tool choice; None when it has no tools (and a tool_choice of none or auto)."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", f"must be a boolean, got {type(parallel).__name__}")
    if tools is not None:
        if not isinstance(tools, list):
            raise bad("tools", "must be a list of function tools")
        if len(tools) > MAX_TOOLS:
            raise bad("tools", f"allows at most {MAX_TOOLS} tools, got {len(tools)}")
        tools = [_tool(t, i) for i, t in enumerate(tools)]
        names = [t["function"]["name"] for t in tools]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise bad("tools", f"names the function {twice[0]!r} more than once")
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type") != "function" or not isinstance(name, str) or set(choice) - {"type", "function"}:
            raise bad("tool_choice", "must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                     "\"function\": {\"name\": ...}}")
        if name not in [t["function"]["name"] for t in tools or []]:
            raise bad("tool_choice", f"names the function {name!r}, which is not in 'tools'")
        return ToolChoice(tuple(tools or ()), NAMED, name, parallel is not False)
    if choice is not None and choice not in (AUTO, NONE, REQUIRED):
        raise bad("tool_choice", f"must be \"none\", \"auto\", \"required\" or a named function, got {choice!r}")
    if not tools:
        if choice == REQUIRED:
            raise bad("tool_choice", "is \"required\" but the request has no 'tools'")
        return None
    return ToolChoice(tuple(tools), choice or AUTO, None, parallel is not False)


def tool_call_schema(choice: ToolChoice) -> dict:
    """The JSON schema the output is constrained to when the request requires calls.

    - a named function: its arguments object (``parameters``), which becomes one call of that function;
    - ``required``: a list of one or more (at most one without parallel calls) ``{"name": N, "parameters":
      {...}}`` objects, each N one of the tools with its own parameters.
    """
    if choice.mode == NAMED:
        assert choice.function is not None
        return choice.parameters(choice.function)
    if choice.mode != REQUIRED:
        raise ValueError(f"tool choice {choice.mode!r} does not constrain the output")
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": t["function"].get("parameters") or NO_ARGUMENTS},
              "required": ["name", "parameters"], "additionalProperties": False}
             for t in choice.tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not choice.parallel:
        schema["maxItems"] = 1
    return schema


def tool_call_output(choice: ToolChoice) -> StructuredOutputSpec:
    """What the engine constrains a required or named tool choice's output to: :func:`tool_call_schema`,
    strict (every JSON-schema keyword enforced) when every function says ``strict: true``, else lenient
    (keywords the grammar library does not implement are not enforced). A schema it cannot take is a 400
    naming ``tool_choice``."""
    strict = all(t["function"].get("strict") is True for t in choice.tools)
    try:
        return StructuredOutputSpec.json_schema(tool_call_schema(choice), strict=strict, param="tool_choice")
    except StructuredOutputError as e:
        raise bad("tool_choice", e.message) from None
