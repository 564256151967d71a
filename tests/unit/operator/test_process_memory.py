"""The operator caps glibc's malloc arenas, so its many threads share two heaps instead of keeping one each."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

# Starts 8 threads that each malloc once (ctypes releases the GIL, and glibc gives a thread its own arena on its
# first malloc while fewer than the cap exist), then counts the heaps glibc reports in malloc_info.
PROBE = textwrap.dedent("""
    import ctypes, os, re, sys, tempfile, threading
    if sys.argv[1] == "cap":
        from tokenfleet_operator.process_memory import limit_malloc_arenas
        assert limit_malloc_arenas()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.fdopen.restype = ctypes.c_void_p
    libc.fdopen.argtypes = (ctypes.c_int, ctypes.c_char_p)
    libc.malloc_info.argtypes = (ctypes.c_int, ctypes.c_void_p)
    libc.fclose.argtypes = (ctypes.c_void_p,)
    held, go = [], threading.Barrier(8)
    def work():
        go.wait()
        held.append(libc.malloc(4096))
        go.wait()
    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads: t.start()
    for t in threads: t.join()
    with tempfile.TemporaryFile() as f:
        fp = libc.fdopen(os.dup(f.fileno()), b"w")
        libc.malloc_info(0, fp)
        libc.fclose(fp)
        f.seek(0)
        print(len(re.findall(rb"<heap nr=", f.read())))
""")


def _heaps(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_the_cap_keeps_many_threads_on_two_heaps():
    assert _heaps("default") > 2          # the probe does make arenas without the cap
    assert _heaps("cap") <= 2


def test_an_explicit_environment_setting_wins(monkeypatch):
    from tokenfleet_operator.process_memory import limit_malloc_arenas
    monkeypatch.setenv("MALLOC_ARENA_MAX", "4")
    assert limit_malloc_arenas() is False
