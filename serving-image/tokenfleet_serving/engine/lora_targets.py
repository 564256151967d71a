"""Which projections a PEFT ``target_modules`` regular expression selects, matched where it cannot hang the server.

PEFT takes a string ``target_modules`` as a regular expression over module names. The adapter's author
chooses it, and Python's ``re`` backtracks: a pattern such as ``(a|a?)+$`` takes exponential time on a
module name, and no thread can stop it. So the pattern is bounded in length (``MAX_PATTERN_CHARS``) and
matched in a child interpreter, with a memory limit, that is killed after ``MATCH_TIMEOUT_S``. A pattern
that takes longer, or does not compile, is refused naming the field. The projections are few and their
names short, so a sane pattern matches in milliseconds.

A projection ``m`` is selected when the pattern matches all of ``m`` or is found in ``layers.0.x.m`` (a
pattern written against full module names, such as ``.*\\.(q_proj|v_proj)``).
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import OrderedDict

MAX_PATTERN_CHARS = 256
MATCH_TIMEOUT_S = 2.0
_MEMORY_LIMIT = 512 << 20
_MATCHER = f"""
import json, re, resource, sys
resource.setrlimit(resource.RLIMIT_AS, ({_MEMORY_LIMIT}, {_MEMORY_LIMIT}))
job = json.load(sys.stdin)
try:
    pattern = re.compile(job["pattern"])
except (re.error, OverflowError, RecursionError) as e:
    print(json.dumps({{"error": str(e)}}))
    sys.exit(0)
print(json.dumps({{"match": [m for m in job["modules"]
                            if pattern.fullmatch(m) or pattern.search("layers.0.x." + m)]}}))
"""


_CACHED = 64
_answers: OrderedDict[tuple[str, tuple[str, ...]], list[str] | TargetPatternError] = OrderedDict()
_lock = threading.Lock()


class TargetPatternError(ValueError):
    """The pattern is refused; the message says why (the caller names the adapter, file and field)."""


def select_by_pattern(pattern: str, modules: tuple[str, ...]) -> list[str]:
    """The ``modules`` the PEFT regular expression ``pattern`` selects (``TargetPatternError`` if it is too
    long, does not compile, or does not finish matching within ``MATCH_TIMEOUT_S``). Answers are kept for
    the last ``_CACHED`` patterns, so an adapters file retrying a refused entry costs no child each time."""
    if len(pattern) > MAX_PATTERN_CHARS:
        raise TargetPatternError(f"a regular expression of {len(pattern)} characters; at most "
                                 f"{MAX_PATTERN_CHARS} are accepted")
    key = (pattern, modules)
    with _lock:
        answer = _answers.get(key)
    if answer is None:
        answer = _match(pattern, modules)
        with _lock:
            _answers[key] = answer
            while len(_answers) > _CACHED:
                _answers.popitem(last=False)
    if isinstance(answer, TargetPatternError):
        raise TargetPatternError(str(answer))
    return list(answer)


def _match(pattern: str, modules: tuple[str, ...]) -> list[str] | TargetPatternError:
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", _MATCHER], capture_output=True, text=True,
                              input=json.dumps({"pattern": pattern, "modules": list(modules)}),
                              timeout=MATCH_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return TargetPatternError(f"the regular expression did not finish matching {len(modules)} module names "
                                  f"in {MATCH_TIMEOUT_S:g} s (it backtracks too much); list the modules instead")
    try:
        answer = json.loads(done.stdout)
    except json.JSONDecodeError:
        return TargetPatternError(f"the regular expression could not be matched (the matcher exited "
                                  f"{done.returncode}: {done.stderr.strip()[-200:]})")
    if "error" in answer:
        return TargetPatternError(f"not a valid regular expression ({answer['error']})")
    return [m for m in answer["match"] if m in modules]
