"""How deep a client's grammar or schema goes, measured without recursion and before anything compiles it.

llguidance compiles a Lark grammar recursively in native code: a chain of about 2,700 rules (``r0: r1``,
``r1: r2``, ...) overflows an 8 MiB stack and kills the process with SIGSEGV, and parentheses inside the
rules deepen the recursion further (1,000 rules with ten parentheses each are enough). So a grammar's
*depth* is the longest chain of rule references from any rule, each rule counting one plus the deepest
nesting of parentheses or brackets in its body; references back into a rule already on the chain
(recursion, as in ``value: "[" value "]"``) end it. A JSON schema's depth is the nesting of its objects and
arrays, and its chains of ``$ref`` through its definitions are measured the same way as a grammar's rules.
All are bounded well below what crashes (``spec.py`` refuses more), and the compile itself runs in
a child process anyway (``sandbox.py``), so a shape these estimates miss costs one request, not the server.
"""
from __future__ import annotations

import re

MAX_GRAMMAR_RULES = 1000     # rule and terminal definitions in one grammar
MAX_GRAMMAR_DEPTH = 300      # longest rule chain, parentheses counted (SIGSEGV from about 2,700)
MAX_SCHEMA_DEPTH = 64        # nested objects and arrays of a JSON schema (llguidance stops at 128)
MAX_SCHEMA_REF_DEPTH = 300   # longest $ref chain through the definitions, nesting counted (SIGSEGV from ~2,300)

_DEFINITION = re.compile(r"^\s*[?!]?([A-Za-z_][A-Za-z0-9_\-]*)\s*(?:\.-?\d+)?\s*(::=|:)(.*)$")
_LITERALS = re.compile(r'"(?:[^"\\\n]|\\.)*"i?|/(?:[^/\\\n]|\\.)+/[imslux]*|//[^\n]*')     # Lark
_GBNF_LITERALS = re.compile(r'"(?:[^"\\\n]|\\.)*"|\[(?:[^\]\\\n]|\\.)*\]|#[^\n]*')           # GBNF (::=)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")


def grammar_rules(text: str) -> dict[str, list[str]]:
    """Each rule's name and its body with string, regex and character-class literals and comments removed (a
    body goes on over the lines that follow it until the next definition)."""
    rules: dict[str, list[str]] = {}
    current: list[str] | None = None
    literals = _GBNF_LITERALS if "::=" in text else _LITERALS
    for line in text.splitlines():
        if line.lstrip().startswith("%"):          # %import, %ignore, %llguidance: no rule
            current = None
            continue
        stripped = literals.sub(" ", line)
        m = _DEFINITION.match(stripped)
        if m:
            current = rules.setdefault(m.group(1), [])
            current.append(m.group(3))
        elif current is not None:
            current.append(stripped)
    return rules


def _nesting(body: str) -> int:
    depth = deepest = 0
    for ch in body:
        if ch in "([{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in ")]}":
            depth = max(0, depth - 1)
    return deepest


def grammar_depth(rules: dict[str, list[str]]) -> int:
    """The longest chain of references, each rule weighing 1 + its nesting."""
    weight = {name: 1 + _nesting(" ".join(body)) for name, body in rules.items()}
    refs = {name: [r for r in dict.fromkeys(_NAME.findall(" ".join(body))) if r in rules and r != name]
            for name, body in rules.items()}
    return longest_chain(weight, refs)


def schema_ref_depth(schema: object) -> int:
    """A JSON schema's longest chain of ``$ref`` s through its ``$defs`` (or ``definitions``), each definition
    weighing 1 + its nesting: llguidance follows them recursively (a chain of about 1,000 object definitions,
    or 2,300 bare references, is a SIGSEGV)."""
    if not isinstance(schema, dict):
        return 0
    defs: dict[str, object] = {}
    for section in ("$defs", "definitions"):
        found = schema.get(section)
        if isinstance(found, dict):
            defs.update({f"#/{section}/{name}": value for name, value in found.items()})
    defs["#"] = schema
    weight = {name: 1 + value_depth(value) for name, value in defs.items()}
    refs = {name: [r for r in dict.fromkeys(_refs(value)) if r in defs and r != name] for name, value in defs.items()}
    return longest_chain(weight, refs)


def _refs(value: object) -> list[str]:
    out: list[str] = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            ref = v.get("$ref")
            if isinstance(ref, str):
                out.append(ref)
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return out


def longest_chain(weight: dict[str, int], refs: dict[str, list[str]]) -> int:
    """The heaviest chain of references (iterative depth-first search); a reference back into the chain (a
    recursion) ends it."""
    longest: dict[str, int] = {}
    for root in weight:
        if root in longest:
            continue
        on_chain = {root}
        stack: list[tuple[str, int]] = [(root, 0)]
        while stack:
            name, i = stack[-1]
            children = refs[name]
            if i < len(children):
                stack[-1] = (name, i + 1)
                child = children[i]
                if child not in longest and child not in on_chain:
                    on_chain.add(child)
                    stack.append((child, 0))
                continue
            stack.pop()
            on_chain.discard(name)
            longest[name] = weight[name] + max((longest.get(c, 0) for c in children if c not in on_chain), default=0)
    return max(longest.values(), default=0)


def json_depth(text: str) -> int:
    """The deepest nesting of objects and arrays in JSON text (strings skipped), without parsing it."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def value_depth(value: object) -> int:
    """The deepest nesting of dicts and lists in a parsed JSON value (iterative)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
        else:
            continue
        deepest = max(deepest, d + 1)
    return deepest
