"""The kernel library an image prebuilds is the one every host looks up.

An image is built on one host and run on others: AVX2-only and AVX-512 EPYCs both occur. The build stage
compiles every variant (``python -m tokenfleet_serving.engine.cpu_kernels --all-variants``); the runtime
looks its variant up by a key of source and flags. These tests pin that every CPU the engine can see maps
to one of the prebuilt keys, whichever CPU the build ran on.
"""
from __future__ import annotations

import platform

import pytest

from tokenfleet_serving.engine import cpu_features, cpu_kernels

AVX2_HOST = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
AVX512_HOST = AVX2_HOST | {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "amx_bf16"}
BASELINE_HOST = frozenset({"sse4_2"})

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86-64 variants")


def _lookup(monkeypatch, host: frozenset[str], cap: str):
    monkeypatch.setattr(cpu_features, "host_flags", lambda: host)
    monkeypatch.setenv(cpu_features.ENV, cap)
    return cpu_kernels.library_path()


def test_two_variants_generic_and_x86_64_v3(monkeypatch):
    paths = [cpu_kernels.library_path(f) for f in cpu_kernels.variants()]
    assert len(set(paths)) == 2
    assert [("-march=x86-64-v3" in f) for f in cpu_kernels.variants()] == [False, True]


@pytest.mark.parametrize("host", [AVX2_HOST, AVX512_HOST], ids=["avx2-host", "avx512-host"])
def test_avx2_and_avx512_hosts_look_up_the_same_x86_64_v3_library(monkeypatch, host):
    v3 = cpu_kernels.library_path(cpu_kernels.flags_for(True))
    assert _lookup(monkeypatch, host, "native") == v3
    assert _lookup(monkeypatch, host, "avx2") == v3


@pytest.mark.parametrize("host", [BASELINE_HOST, AVX2_HOST, AVX512_HOST])
def test_every_host_and_cap_finds_a_prebuilt_variant(monkeypatch, host):
    prebuilt = {cpu_kernels.library_path(f) for f in cpu_kernels.variants()}
    for cap in cpu_features.CAPS:
        assert _lookup(monkeypatch, host, cap) in prebuilt, (sorted(host), cap)
    assert _lookup(monkeypatch, host, "baseline") == cpu_kernels.library_path(cpu_kernels.flags_for(False))


def test_the_key_depends_on_flags_and_cache_dir_not_on_the_build_host(monkeypatch, tmp_path):
    monkeypatch.setenv("TOKENFLEET_KERNEL_CACHE", str(tmp_path))
    built_on_avx512 = _lookup(monkeypatch, AVX512_HOST, "native")
    run_on_avx2 = _lookup(monkeypatch, AVX2_HOST, "native")
    assert built_on_avx512 == run_on_avx2 and built_on_avx512.parent == tmp_path


def test_a_built_library_is_readable_by_every_user(monkeypatch, tmp_path):
    """Images build the kernels as root and run them as an unprivileged user."""
    monkeypatch.setenv("TOKENFLEET_KERNEL_CACHE", str(tmp_path))
    path = cpu_kernels.build()
    assert path.stat().st_mode & 0o044 == 0o044
