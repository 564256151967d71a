"""The difficulty of one request, from the request itself: pure functions (route mode, docs/routing.md).

**Rules** (thresholds from the TokenRoute's ``spec.difficulty``; a threshold left unset turns its rule off).
A request scores one point for each rule it trips:

- ``prompt-tokens``: more prompt tokens than ``maxPromptTokens`` (counted with the first target's tokenizer and
  chat template, as that server counts them; without a tokenizer, characters / 4);
- ``max-tokens``: more requested output tokens (``max_tokens``, ``max_completion_tokens``) than
  ``maxOutputTokens``, or none requested on a chat request (it may run to the end of the context);
- ``turns``: more user turns than ``maxTurns`` (chat only);
- ``tools``: a non-empty ``tools`` list (when ``tools`` is on);
- ``schema``: JSON output asked for (``response_format`` of type ``json_object`` or ``json_schema``, or
  ``structured_outputs``; when ``responseSchema`` is on).

The score picks the target by position: 0 the first (cheapest), 1 the second, ..., the last for any higher
score. With two targets every tripped rule sends a request to the large model.

**Classifier** (optional): a model asked ``grading_prompt`` answers with a word; ``parse_grade`` reads
``hard`` or ``easy`` from its first word (anything else is no grade, and the rules decide). A hard grade
sends the request to the last target; an easy grade leaves the rules' score in force.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenfleet_serving.contract.route_files import Difficulty

RULES = ("prompt-tokens", "max-tokens", "turns", "tools", "schema")


@dataclass(frozen=True)
class Features:
    """What the scorer reads of a request."""

    prompt_tokens: int
    max_tokens: int | None          # requested output tokens; None: not given
    chat: bool
    turns: int = 0                  # user messages (chat)
    tools: bool = False
    schema: bool = False


@dataclass(frozen=True)
class Score:
    points: int
    rules: tuple[str, ...]          # the rules tripped, in RULES order


def features(kind: str, body: Any, prompt_tokens: int, max_tokens: int | None) -> Features:
    """Features of a decoded request body (``kind``: "chat" or "completion"); ``prompt_tokens`` and
    ``max_tokens`` as ``router/prompt.py`` parsed them."""
    if not isinstance(body, dict):
        return Features(prompt_tokens, max_tokens, kind == "chat")
    if max_tokens is None:
        for key in ("max_completion_tokens", "max_tokens"):
            value = body.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                max_tokens = value
                break
    messages = body.get("messages") if kind == "chat" else None
    turns = sum(1 for m in messages if isinstance(m, dict) and m.get("role") == "user") \
        if isinstance(messages, list) else 0
    tools = isinstance(body.get("tools"), list) and len(body["tools"]) > 0
    fmt = body.get("response_format")
    schema = (isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema")) \
        or body.get("structured_outputs") is not None
    return Features(prompt_tokens, max_tokens, kind == "chat", turns, tools, schema)


def score(f: Features, d: Difficulty) -> Score:
    tripped = []
    if d.max_prompt_tokens is not None and f.prompt_tokens > d.max_prompt_tokens:
        tripped.append("prompt-tokens")
    if d.max_output_tokens is not None and (
            (f.max_tokens is None and f.chat) or (f.max_tokens is not None and f.max_tokens > d.max_output_tokens)):
        tripped.append("max-tokens")
    if d.max_turns is not None and f.turns > d.max_turns:
        tripped.append("turns")
    if d.tools and f.tools:
        tripped.append("tools")
    if d.response_schema and f.schema:
        tripped.append("schema")
    return Score(len(tripped), tuple(tripped))


GRADE_CHARS = 2000      # the grader sees at most this much of the request (its end: the latest turn)


def grading_prompt(kind: str, body: Any) -> str:
    """The completion prompt the classifier model answers: the request's text, then the question."""
    text = ""
    if isinstance(body, dict):
        if kind == "chat" and isinstance(body.get("messages"), list):
            parts = []
            for m in body["messages"]:
                if isinstance(m, dict):
                    content = m.get("content")
                    if isinstance(content, list):
                        content = " ".join(p.get("text", "") for p in content if isinstance(p, dict))
                    parts.append(f"{m.get('role', 'user')}: {content if isinstance(content, str) else ''}")
            text = "\n".join(parts)
        elif isinstance(body.get("prompt"), str):
            text = body["prompt"]
    text = text[-GRADE_CHARS:]
    return ("Grade how hard this request is for a language model. Answer with one word, easy or hard.\n\n"
            f"Request:\n{text}\n\nGrade:")


def parse_grade(text: str) -> str | None:
    """``hard`` or ``easy`` from the classifier's answer (its first word, case and punctuation aside); None for
    anything else."""
    words = text.strip().split()
    if not words:
        return None
    word = words[0].strip(".,:;!\"'()[]").lower()
    return word if word in ("easy", "hard") else None
