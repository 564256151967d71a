"""How the operator's process uses the C allocator.

glibc gives each thread that contends for the heap an arena of its own, up to eight per core, and memory freed
in an arena stays with it. The operator's threads (the queue's workers, the gang pass's writers, the
collector, each /metrics scrape) all parse large JSON answers, so with the default every one of them keeps
its own high-water mark of freed buffers: at 1,000 services that was about 40 MB of RSS that nothing used.
Two arenas are shared by all threads instead (what ``MALLOC_ARENA_MAX=2`` does); Python's own small-object
allocator is untouched, and the threads mostly wait on the API server, so they rarely contend for the lock.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger("tokenfleet.memory")

M_ARENA_MAX = -8          # glibc's mallopt parameter (malloc.h)
ARENAS = 2


def limit_malloc_arenas(arenas: int = ARENAS) -> bool:
    """Cap glibc's malloc arenas for threads started from now on; an explicit ``MALLOC_ARENA_MAX`` in the
    environment wins. Returns whether the cap was set (False where the C library is not glibc)."""
    if os.environ.get("MALLOC_ARENA_MAX"):
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = mallopt(M_ARENA_MAX, arenas) == 1
    if not done:
        log.debug("mallopt(M_ARENA_MAX, %d) was refused", arenas)
    return done
