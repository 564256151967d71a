"""dtype 'auto' on a CPU is measured: both candidates run the probe, the faster correct one wins, the result
is cached per host and model shape, and TOKENFLEET_CPU_ISA caps what the engine sees."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenfleet_serving.engine import LLMEngine, cpu_features, cpu_kernels, dtype_choice
from tokenfleet_serving.engine.loader import load_config
from tokenfleet_serving.engine.model_runner import ModelRunner


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENFLEET_KERNEL_CACHE", str(tmp_path / "kernels"))
    return tmp_path / "dtype-choice.json"


def test_auto_measures_both_candidates_and_takes_the_faster(llama_dir, cache, monkeypatch):
    config = load_config(llama_dir)
    speeds = dtype_choice.measure(config, dtype_choice.cpu_candidates())
    assert set(speeds) == {"float32", "bfloat16"} and all(v > 0 for v in speeds.values()), speeds
    probes = []
    real = dtype_choice.measure
    monkeypatch.setattr(dtype_choice, "measure", lambda *a, **k: probes.append(1) or real(*a, **k))
    choice = dtype_choice.choose_dtype("auto", torch.device("cpu"), config)
    assert choice.how == "measured" and len(probes) == 1
    assert choice.name == max(choice.probe_tokens_per_second, key=choice.probe_tokens_per_second.get)
    again = dtype_choice.choose_dtype("auto", torch.device("cpu"), config)
    assert (again.how, again.dtype, len(probes)) == ("cached", choice.dtype, 1)      # no second probe
    assert cache.exists()


def test_the_cache_is_keyed_by_what_the_choice_depends_on(llama_dir, monkeypatch):
    config = load_config(llama_dir)
    key = lambda cfg=config: dtype_choice._cache_key(cfg, dtype_choice.cpu_candidates(), True)
    base = key()
    assert key(dataclasses.replace(config, hidden_size=config.hidden_size * 2)) != base
    assert key(dataclasses.replace(config, eos_token_ids=(7,))) == base          # no shape: same probe
    monkeypatch.setenv("TOKENFLEET_CPU_ISA", "baseline")
    assert key() != base
    monkeypatch.setattr(torch, "get_num_threads", lambda: 97)
    assert dtype_choice._cache_key(config, dtype_choice.cpu_candidates(), True) != base


def test_a_candidate_with_non_finite_logits_is_not_correct(llama_dir):
    config = dtype_choice.probe_config(load_config(llama_dir))
    weights = dtype_choice.probe_weights(config)
    weights["model.norm.weight"] = torch.full_like(weights["model.norm.weight"], float("nan"))
    model = ModelRunner(config, weights, torch.float32, torch.device("cpu"), 64)
    model.allocate_kv_cache(dtype_choice.PROBE_SEQS * 4, dtype_choice.PROBE_BLOCK)
    seconds, finite = dtype_choice._run_probe(model, config.vocab_size, seed=0)
    assert seconds > 0 and not finite


def test_the_engine_runs_in_the_dtype_auto_chose(llama_dir, cache):
    eng = LLMEngine.from_pretrained(llama_dir, dtype="auto", kv_cache_bytes=1 << 20, block_size=4)
    assert eng.dtype_choice.how in ("measured", "cached")
    assert eng.dtype == eng.dtype_choice.dtype and eng.runner.kv_pool.dtype == eng.dtype
    out = eng.generate([[1, 2, 3]], dtype_choice_params())[0]
    assert len(out.new_token_ids) == 3


def dtype_choice_params():
    from tokenfleet_serving.engine import SamplingParams
    return SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("cap, avx2_kernels", [("avx2", True), ("baseline", False)])
def test_the_isa_cap_hides_what_the_host_has(monkeypatch, cap, avx2_kernels):
    monkeypatch.setenv("TOKENFLEET_CPU_ISA", cap)
    flags = cpu_features.cpu_flags()
    assert not any(f.startswith("avx512") for f in flags) and not cpu_features.has_native_bf16()
    assert ("-march=x86-64-v3" in cpu_kernels.compile_flags()) == (avx2_kernels and cpu_features.has_avx2_fma())
    assert cpu_features.isa_level() == (cap if cap != "avx2" or cpu_features.has_avx2_fma() else "baseline")
    assert cpu_features.torch_env()["ATEN_CPU_CAPABILITY"] in ("avx2", "default")
    # the GEMMs of fp32 linear layers are oneMKL's, which picks its own instructions unless told
    assert cpu_features.torch_env()["MKL_ENABLE_INSTRUCTIONS"] == {"avx2": "AVX2", "baseline": "SSE4_2"}[cap]


def test_a_bad_isa_cap_is_refused(monkeypatch):
    monkeypatch.setenv("TOKENFLEET_CPU_ISA", "avx9000")
    with pytest.raises(cpu_features.CpuIsaError, match="TOKENFLEET_CPU_ISA"):
        cpu_features.cpu_flags()


def test_native_reports_the_host_as_it_is(monkeypatch):
    monkeypatch.delenv("TOKENFLEET_CPU_ISA", raising=False)
    assert cpu_features.cpu_flags() == cpu_features.host_flags()
    assert cpu_features.torch_env() == {}
