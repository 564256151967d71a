"""The int8 KV cache (``engine/kv_quant.py``, ``--kv-cache-dtype int8``): the quantizer's error bound, the C
kernels against the PyTorch path over the same int8 pool (write bit for bit, attention within rounding), the
engine's greedy tokens against the model dtype's, its capacity at a fixed budget, and how it composes with
prefix caching, chunked prefill, speculative decoding, tensor parallelism and prefix-cache checkpoints, or is
refused. Run with ``TOKENFLEET_CPU_ISA=avx2`` and ``baseline`` too: the kernels have AVX2 and portable loops."""
from __future__ import annotations

import ctypes
import random

import pytest
import torch

from tokenfleet_serving.contract.levers import QuantizationError, kv_bytes_per_token, parse_kv_cache_dtype
from tokenfleet_serving.engine import LLMEngine, SamplingParams, cpu_kernels, kv_quant
from tokenfleet_serving.engine.kv_quant import QuantizedKV

GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def lib():
    lib = cpu_kernels.load()
    assert lib is not None, "the C kernels did not build"
    return lib


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """The library as a build without AVX2 + FMA has it (the portable loops)."""
    import os
    old = os.environ.get("TOKENFLEET_KERNEL_CACHE")
    os.environ["TOKENFLEET_KERNEL_CACHE"] = str(tmp_path_factory.mktemp("portable"))
    try:
        flags = [f for f in cpu_kernels.flags_for(False)]
        return cpu_kernels.bind(ctypes.CDLL(str(cpu_kernels.build(flags=flags))))
    finally:
        if old is None:
            del os.environ["TOKENFLEET_KERNEL_CACHE"]
        else:
            os.environ["TOKENFLEET_KERNEL_CACHE"] = old


# ---- the quantizer -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_error_is_at_most_half_a_step_of_each_vectors_scale(dtype):
    torch.manual_seed(0)
    x = torch.randn(64, 8, 128) * torch.logspace(-6, 3, 64)[:, None, None]     # magnitudes 1e-6 .. 1e3
    x[3, 2, 7] = 5e4                                                          # an outlier in one vector
    x[5, 1] = 0.0                                                             # a zero vector
    x = x.to(dtype)
    q, scale = kv_quant.quantize(x)
    assert q.dtype == torch.int8 and scale.dtype == torch.bfloat16 and scale.shape == x.shape[:-1]
    assert int(q.abs().max()) <= 127
    back = kv_quant.dequantize(q, scale, torch.float32)
    amax = x.float().abs().amax(-1, keepdim=True)
    err = (back - x.float()).abs()
    # half a step (max|x| / 254), plus what rounding the scale to bf16 may clamp (at most 2^-8 of max|x|),
    # plus the bf16 rounding of the result where the dtype is bf16
    bound = amax / 254 * 1.01 + (amax * 2**-8 if dtype == torch.bfloat16 else 0) + 1e-30
    assert (err <= bound).all()
    assert (back[5, 1] == 0).all()
    # the element that sets the scale comes back to within the scale's own rounding
    assert abs(float(back[3, 2, 7]) - 5e4) <= 5e4 * 2**-8
    # and the error is unbiased and small on average: about a quarter step
    rel = (err / amax.clamp_min(1e-30)).mean()
    assert rel < 1 / 254 / 1.5


def test_parse_kv_cache_dtype_takes_auto_and_int8_and_refuses_fp8_naming_the_field():
    assert parse_kv_cache_dtype(None) == "auto" and parse_kv_cache_dtype("INT8") == "int8"
    with pytest.raises(QuantizationError, match="--kv-cache-dtype: fp8 is not implemented"):
        parse_kv_cache_dtype("fp8", "--kv-cache-dtype")
    with pytest.raises(QuantizationError, match="kv_cache_dtype must be one of auto, int8"):
        parse_kv_cache_dtype("int4")


def test_kv_bytes_per_token_counts_the_scales():
    # Llama-3-8B: 32 layers, 8 KV heads, head_dim 128
    assert kv_bytes_per_token(32, 8, 128, 2) == 131072
    assert kv_bytes_per_token(32, 8, 128, 2, "int8") == 2 * 32 * 8 * 130
    assert kv_bytes_per_token(8, 4, 64, 2) / kv_bytes_per_token(8, 4, 64, 2, "int8") > 1.9


# ---- kernels against the PyTorch path --------------------------------------------------------------------------
def _int8_pool(kv_heads, num_blocks, block_size, head_dim, seed):
    torch.manual_seed(seed)
    k = torch.randn(kv_heads, num_blocks, block_size, head_dim) * 3
    v = torch.randn(kv_heads, num_blocks, block_size, head_dim)
    (kq, ks), (vq, vs) = kv_quant.quantize(k), kv_quant.quantize(v)
    return kq, ks, vq, vs, kv_quant.dequantize(kq, ks, torch.float32), kv_quant.dequantize(vq, vs, torch.float32)


@pytest.mark.parametrize("which", ["native", "portable"])
@pytest.mark.parametrize("head_dim", [16, 36, 64, 128])
def test_the_kernels_kv_write_stores_the_bits_of_kv_quant_quantize(lib, portable, which, head_dim):
    kernels = lib if which == "native" else portable
    kv_heads, blocks, bs = 2, 9, 4
    torch.manual_seed(head_dim)
    rows = torch.randn(7, 2 * kv_heads + 3, head_dim) * torch.logspace(-3, 2, 7)[:, None, None]
    k, v = rows[:, :kv_heads], rows[:, kv_heads:2 * kv_heads]                    # strided rows, as the model has
    slots = torch.tensor([0, 5, 6, 13, 20, 33, 35])
    data = torch.zeros(2, kv_heads, blocks, bs, head_dim, dtype=torch.int8)
    scales = torch.zeros(2, kv_heads, blocks, bs, dtype=torch.bfloat16)
    cpu_kernels.write_kv_int8(kernels, k, v, slots, data[0], data[1], scales[0], scales[1])
    want_d, want_s = torch.zeros_like(data), torch.zeros_like(scales)
    for i, x in enumerate((k, v)):
        q, s = kv_quant.quantize(x.transpose(0, 1))
        want_d[i].view(kv_heads, -1, head_dim).index_copy_(1, slots, q)
        want_s[i].view(kv_heads, -1).index_copy_(1, slots, s)
    assert torch.equal(data, want_d) and torch.equal(scales, want_s)


@pytest.mark.parametrize("which", ["native", "portable"])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 4, 64), (4, 1, 36), (6, 2, 128), (4, 2, 16)])
def test_decode_kernel_over_an_int8_pool_matches_sdpa_over_its_dequantized_blocks(lib, portable, which, heads,
                                                                                   kv_heads, head_dim):
    from test_engine_kernels import reference_decode_attention

    kernels = lib if which == "native" else portable
    rng = random.Random(head_dim)
    bs = 4
    lens = [1, 3, 4, 5, 37, 97]
    width = max(-(-n // bs) for n in lens) + 1
    num_blocks = len(lens) * width + 3
    kq, ks, vq, vs, kd, vd = _int8_pool(kv_heads, num_blocks, bs, head_dim, head_dim)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = torch.tensor(ids[:len(lens) * width]).view(len(lens), width)
    q = torch.randn(len(lens), heads + kv_heads, head_dim)[:, :heads]
    out = torch.full((len(lens), heads * head_dim), float("nan"))
    cpu_kernels.paged_decode_attention(kernels, q, kq, vq, tables, torch.tensor(lens), max(lens), out,
                                       head_dim ** -0.5, ks, vs)
    ref = reference_decode_attention(q, kd, vd, tables, torch.tensor(lens), head_dim ** -0.5)
    assert (out - ref).abs().max() < 1e-5


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,chunks", [
    (8, 4, 64, 16, [(0, 40), (100, 7), (600, 32)]),
    (4, 1, 32, 4, [(0, 2), (3, 200)]),
    (4, 2, 16, 4, [(9, 30)]),
])
def test_prefill_kernel_over_an_int8_pool_matches_sdpa_over_its_dequantized_blocks(lib, heads, kv_heads, head_dim,
                                                                                    block_size, chunks):
    from test_engine_kernels import reference_prefill_attention

    if not cpu_kernels.prefill_attends(lib, head_dim):
        pytest.skip("this build has no prefill kernel (TOKENFLEET_CPU_ISA=baseline): SDPA runs prefill")
    rng = random.Random(heads + head_dim)
    n_q, starts = torch.tensor([n for _, n in chunks]), torch.tensor([s for s, _ in chunks])
    width = max(-(-(s + n) // block_size) for s, n in chunks) + 1
    num_blocks = len(chunks) * width + 3
    kq, ks, vq, vs, kd, vd = _int8_pool(kv_heads, num_blocks, block_size, head_dim, heads)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = torch.tensor(ids[:len(chunks) * width]).view(len(chunks), width)
    q_rows = torch.cumsum(torch.cat([torch.tensor([2]), n_q[:-1]]), 0)
    rows = int(q_rows[-1] + n_q[-1]) + 2
    q = torch.randn(rows, heads + kv_heads, head_dim)[:, :heads]
    out = torch.full((rows, heads * head_dim), float("nan"))
    cpu_kernels.prefill_attention(lib, q, kq, vq, tables, q_rows, n_q, starts, out, head_dim ** -0.5,
                                  k_scales=ks, v_scales=vs)
    ref = reference_prefill_attention(q, kd, vd, tables, q_rows, n_q, starts, head_dim ** -0.5)
    mine = ~ref.isnan()
    assert (out[mine] - ref[mine]).abs().max() < 1e-5 and out[~mine].isnan().all()


def test_the_kernels_refuse_an_int8_pool_without_its_scales(lib):
    kq = torch.zeros(1, 2, 4, 16, dtype=torch.int8)
    with pytest.raises(ValueError, match="fp32 cache layers"):
        cpu_kernels.paged_decode_attention(lib, torch.zeros(1, 1, 16), kq, kq, torch.zeros(1, 1, dtype=torch.long),
                                           torch.ones(1, dtype=torch.long), 1, torch.zeros(1, 16), 0.25)


# ---- the engine --------------------------------------------------------------------------------------------------
def _prompts(vocab: int, n: int = 6, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [3, 17, 40, 64, 129, 300][:n]
    return [torch.randint(0, vocab, (m,), generator=g).tolist() for m in lengths]


def _engine(model, **kw):
    kw.setdefault("kv_cache_bytes", 2 << 20)
    return LLMEngine.from_pretrained(model, dtype="float32", block_size=4, load_tokenizer=False, **kw)


def _greedy(eng, prompts, params=GREEDY):
    return [o.new_token_ids for o in eng.generate(prompts, params)]


@pytest.mark.parametrize("name", ["llama", "llama3-tied", "qwen2"])
def test_kernels_and_pytorch_path_give_the_same_greedy_tokens_and_close_logits_with_an_int8_cache(checkpoints,
                                                                                                 name):
    model = checkpoints[name]
    prompts = _prompts(512)
    fast, plain = _engine(model, kv_cache_dtype="int8"), _engine(model, kv_cache_dtype="int8", cpu_kernels=False)
    assert fast.runner.kernels is not None and plain.runner.kernels is None
    assert _greedy(fast, prompts) == _greedy(plain, prompts)
    # logits of a prefix hit + decode steps on both paths
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5)
    a = fast.generate([prompts[4] + [7, 8, 9]], params)[0]
    b = plain.generate([prompts[4] + [7, 8, 9]], params)[0]
    assert a.num_cached_tokens > 0 and b.num_cached_tokens > 0
    for x, y in zip(a.logprobs, b.logprobs):
        assert abs(x.logprob - y.logprob) < 1e-4


def test_int8_cache_keeps_the_model_dtypes_greedy_tokens_outside_near_ties_and_holds_more_blocks(checkpoints):
    model = checkpoints["llama"]
    prompts = _prompts(512)
    from tokenfleet_serving.bench.levers import greedy_agreement

    full, int8 = _engine(model), _engine(model, kv_cache_dtype="int8")
    # teacher-forced: int8's argmax after the model dtype's own tokens (a free-running comparison would count
    # every token after the first near tie)
    g = greedy_agreement(full, int8, prompts[:4], 24, 0.05)
    assert g["agreement"] >= 0.9 and g["agreement_outside_near_ties"] == 1.0, g      # misses: gaps < 0.05 only
    # head_dim 16 in fp32: 64 bytes per head and token against 16 + 2
    assert int8.kv.pool.num_blocks == (2 << 20) // int8.runner.kv_block_bytes(4)
    assert int8.kv.pool.num_blocks / full.kv.pool.num_blocks > 3.4
    assert int8.runner.kv_bytes() <= 2 << 20 and int8.kv_cache_bytes == int8.runner.kv_bytes()


def test_chunked_prefill_preemption_and_ngram_speculation_with_an_int8_cache_give_its_plain_tokens(checkpoints):
    from tokenfleet_serving.engine.speculative import SpeculativeConfig

    model = checkpoints["llama"]
    prompts = _prompts(512) + [([5, 6, 7, 8] * 10)[:37]]
    want = _greedy(_engine(model, kv_cache_dtype="int8", kv_cache_bytes=8 << 20), prompts)
    chunked = _engine(model, kv_cache_dtype="int8", max_num_batched_tokens=32, kv_cache_bytes=8 << 20)
    assert _greedy(chunked, prompts) == want and chunked.stats().num_chunked_prefills > 0
    spec = _engine(model, kv_cache_dtype="int8", kv_cache_bytes=8 << 20,
                   speculative=SpeculativeConfig("ngram", 3, prompt_lookup_min=1, adaptive=False))
    assert _greedy(spec, prompts) == want and spec.stats().spec_decode.num_drafts > 0
    # a pool too small for all of them at once: some are preempted and recomputed
    tight = _engine(model, kv_cache_dtype="int8", kv_cache_bytes=180 * tight_block_bytes(model))
    assert _greedy(tight, prompts) == want and tight.stats().num_preemptions > 0


def tight_block_bytes(model) -> int:
    return _engine(model, kv_cache_dtype="int8", kv_cache_bytes=1 << 16).runner.kv_block_bytes(4)


def test_an_engine_refuses_an_fp8_cache_naming_the_field(checkpoints):
    with pytest.raises(QuantizationError, match="kv_cache_dtype: fp8 is not implemented"):
        _engine(checkpoints["llama"], kv_cache_dtype="fp8")


def test_serve_takes_kv_cache_dtype_and_refuses_fp8():
    from tokenfleet_serving.serve_args import ServeArgsError, parse_serve_args

    assert parse_serve_args(["--model", "m", "--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"
    assert parse_serve_args(["--model", "m"]).kv_cache_dtype == "auto"
    with pytest.raises(ServeArgsError, match="fp8 is not implemented"):
        parse_serve_args(["--model", "m", "--kv-cache-dtype", "fp8"])


def test_the_disk_tier_keeps_int8_blocks_with_their_scales_and_only_an_int8_engine_loads_them(checkpoints, tmp_path):
    from tokenfleet_serving.engine.kv_offload import KVOffloadConfig

    def disk(host_bytes: int = 0) -> KVOffloadConfig:
        return KVOffloadConfig(host_bytes, str(tmp_path / "kv"), 64 << 20)

    model = checkpoints["llama"]
    shared = _prompts(512)[3]
    writer = _engine(model, kv_cache_dtype="int8", kv_offload=disk(8 << 20))
    _greedy(writer, [shared + [1, 2]])
    assert writer.flush_kv_to_disk(1000) >= 16
    writer.close()
    reader = _engine(model, kv_cache_dtype="int8", kv_offload=disk())
    assert len(reader.cached_block_hashes_by_tier()["disk"]) >= 16
    warm = reader.generate([shared + [3, 4]], GREEDY)[0]
    cold = _engine(model, kv_cache_dtype="int8").generate([shared + [3, 4]], GREEDY)[0]
    assert warm.num_cached_tokens == 64 and warm.new_token_ids == cold.new_token_ids
    reader.close()
    # blocks of an int8 cache are foreign to a cache in the model's dtype: never listed, never loaded
    other = _engine(model, kv_offload=disk())
    assert other.cached_block_hashes_by_tier()["disk"] == []
    assert other.generate([shared + [3, 4]], GREEDY)[0].num_cached_tokens == 0
    other.close()


def test_int8_cache_at_tp2_gives_tp1s_tokens_and_each_rank_holds_its_kv_heads(checkpoints):
    from tokenfleet_serving.bench.parallel import open_engine

    model = checkpoints["llama"]
    prompts = _prompts(512, n=4)

    def run(tp):
        engine = open_engine(model, tp, threads=1, kv_cache_bytes=2 << 20, block_size=4, kv_cache_dtype="int8")
        try:
            return _greedy(engine, prompts), engine.kv.pool.num_blocks, engine.runner.kv_pool.shape[2]
        finally:
            engine.close()

    one, blocks_one, heads_one = run(1)
    two, blocks_two, heads_two = run(2)
    assert two == one and heads_two == heads_one // 2 and blocks_two >= 2 * blocks_one - 1


def test_pools_layout_is_an_int8_tensor_and_bf16_scales_per_layer(checkpoints):
    eng = _engine(checkpoints["llama"], kv_cache_dtype="int8")
    layer = eng.runner.kv_layers[0]
    assert isinstance(layer, QuantizedKV) and layer.data.dtype == torch.int8 and layer.scales.dtype == torch.bfloat16
    assert layer.scales.shape == layer.data.shape[:-1]
    _greedy(eng, _prompts(512, n=2))
    assert eng.runner.kv_scales is not None and float(eng.runner.kv_scales.float().abs().max()) > 0


# ---- the budget at start (issue 34, item 1) ------------------------------------------------------------------
def test_the_budget_from_memory_utilization_is_that_fraction_less_weights_and_headroom(checkpoints):
    from tokenfleet_serving.contract.kv_budget import HEADROOM_BYTES

    model = checkpoints["llama"]
    eng = _engine(model, memory_utilization=0.5, device_memory_bytes=3 << 30)
    want = int(0.5 * (3 << 30)) - eng.runner.weight_bytes() - HEADROOM_BYTES
    assert want - eng.runner.kv_block_bytes(4) < eng.kv_cache_bytes <= want
    with pytest.raises(ValueError, match="--gpu-memory-utilization 0.3 .*leaves no room"):
        _engine(model, memory_utilization=0.3, device_memory_bytes=3 << 30)


def test_a_cpu_rank_never_sizes_from_more_memory_than_it_has():
    # an accelerator pod on a node that only pretends to hold the device (KWOK) runs on the CPU: the stated
    # 80 GiB of an H100 must not become an 72 GiB KV pool on a smaller machine
    from tokenfleet_serving.engine.worker import device_memory_bytes, usable_memory_bytes

    cpu = torch.device("cpu")
    have = device_memory_bytes(cpu)
    assert usable_memory_bytes(cpu, None) == have
    assert usable_memory_bytes(cpu, have * 4) == have
    assert usable_memory_bytes(cpu, 1 << 30) == min(1 << 30, have)


def test_a_max_model_len_the_pool_cannot_hold_once_is_refused_at_start_naming_the_fields(checkpoints):
    model = checkpoints["llama"]
    block = _engine(model, kv_cache_bytes=1 << 16).runner.kv_block_bytes(4)
    with pytest.raises(ValueError, match=r"--max-model-len 400 \(engine.maxModelLen\) does not fit"):
        _engine(model, kv_cache_bytes=99 * block, max_model_len=400)
    assert _engine(model, kv_cache_bytes=100 * block, max_model_len=400).max_model_len == 400
    # int8 holds the same context in fewer bytes
    assert _engine(model, kv_cache_bytes=40 * block, max_model_len=400, kv_cache_dtype="int8").max_model_len == 400
