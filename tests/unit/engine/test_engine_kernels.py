"""The engine's CPU fast paths against their plain PyTorch definitions.

* the compiled paged decode- and prefill-attention kernels (csrc/cpu_kernels.c) vs
  scaled_dot_product_attention over keys gathered from the same scattered blocks, the fused
  add + RMSNorm vs F.rms_norm, SwiGLU vs F.silu(gate) * up, RoPE vs the model's torch rotation, the
  KV-cache write vs index_copy_;
* its build cache and its fallbacks (switched off, no compiler, broken source);
* the Linear paths (packed GEMM, oneDNN, F.linear) vs F.linear, and the bound on the row counts it hands
  to oneDNN.
"""
from __future__ import annotations

import logging
import random

import pytest
import torch
import torch.nn.functional as F

from tokenfleet_serving.engine import cpu_kernels
from tokenfleet_serving.engine.layers.linear import Linear


def gathered(layer, table, n, heads):
    """The first n keys (or values) of a sequence, gathered through its block table, one copy per query
    head (GQA by repeating kv heads): [heads, n, head_dim]."""
    kv_heads = layer.shape[0]
    return layer[:, table].reshape(kv_heads, -1, layer.shape[-1])[:, :n].repeat_interleave(heads // kv_heads, 0)


def reference_decode_attention(q, k_layer, v_layer, tables, lens, scale):
    """Per sequence: gather its blocks, cut to its length, attend with SDPA."""
    heads = q.shape[1]
    out = []
    for s in range(q.shape[0]):
        n = int(lens[s])
        keys, vals = gathered(k_layer, tables[s], n, heads), gathered(v_layer, tables[s], n, heads)
        o = F.scaled_dot_product_attention(q[s].unsqueeze(1), keys, vals, scale=scale)     # [H, 1, hd]
        out.append(o.reshape(-1))
    return torch.stack(out)


@pytest.fixture(scope="module")
def lib():
    lib = cpu_kernels.load()
    assert lib is not None, "the C kernels did not build (is gcc installed? hack/setup.sh installs it)"
    return lib


@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (4, 1), (6, 6)])
@pytest.mark.parametrize("head_dim", [32, 36, 64, 80, 128])      # 36: not a multiple of 8, the scalar loop
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_kernel_matches_sdpa_over_scattered_blocks(lib, heads, kv_heads, head_dim, block_size):
    rng = random.Random(heads * 1000 + head_dim * 10 + block_size)
    torch.manual_seed(rng.randrange(1 << 30))
    lens = [1, block_size, block_size + 1, 3 * block_size - 1, rng.randrange(1, 200), 97]
    width = max(-(-n // block_size) for n in lens) + 1                 # tables are padded past each length
    num_blocks = len(lens) * width + 5
    k_layer = torch.randn(kv_heads, num_blocks, block_size, head_dim)
    v_layer = torch.randn(kv_heads, num_blocks, block_size, head_dim)
    ids = list(range(num_blocks))
    rng.shuffle(ids)                                                   # scattered, not in order
    tables = torch.tensor(ids[:len(lens) * width]).view(len(lens), width)
    lens_t = torch.tensor(lens)
    # queries as the model has them: a view into [T, heads + kv_heads, hd] rows (strided)
    qk = torch.randn(len(lens) + 2, heads + kv_heads, head_dim)
    q = qk[:len(lens), :heads]
    out = torch.full((len(lens) + 2, heads * head_dim), float("nan"))
    scale = head_dim ** -0.5
    cpu_kernels.paged_decode_attention(lib, q, k_layer, v_layer, tables, lens_t, max(lens), out, scale)
    ref = reference_decode_attention(q, k_layer, v_layer, tables, lens_t, scale)
    assert (out[:len(lens)] - ref).abs().max() < 1e-5
    assert out[len(lens):].isnan().all()                               # rows past the sequences untouched


@pytest.mark.parametrize("head_dim", [64, 36])          # the AVX2 item and the portable loop
def test_decode_kernel_gives_zeros_for_a_sequence_with_no_keys(lib, head_dim):
    k_layer = torch.randn(2, 4, 4, head_dim)
    q = torch.randn(2, 4, head_dim)
    out = torch.full((2, 4 * head_dim), float("nan"))
    cpu_kernels.paged_decode_attention(lib, q, k_layer, k_layer.clone(), torch.tensor([[0], [1]]), torch.tensor([0, 3]),
                                       3, out, head_dim ** -0.5)
    assert (out[0] == 0).all() and out[1].isfinite().all()


def reference_prefill_attention(q, k_layer, v_layer, tables, q_rows, n_q, starts, scale):
    """Per chunk: gather its sequence's keys, attend causally from its start (query i sees keys <= start + i)."""
    heads, hd = q.shape[1], q.shape[2]
    out = torch.full((q.shape[0], heads * hd), float("nan"))
    for s in range(len(n_q)):
        n, start, row, count = int(starts[s] + n_q[s]), int(starts[s]), int(q_rows[s]), int(n_q[s])
        keys, vals = gathered(k_layer, tables[s], n, heads), gathered(v_layer, tables[s], n, heads)
        mask = torch.arange(n)[None, :] <= (start + torch.arange(count))[:, None]
        o = F.scaled_dot_product_attention(q[row:row + count].transpose(0, 1), keys, vals, attn_mask=mask, scale=scale)
        out[row:row + count] = o.transpose(0, 1).reshape(count, heads * hd)
    return out


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,chunks", [
    (8, 4, 64, 16, [(0, 40), (100, 7), (2048, 32)]),      # (tokens cached before, new tokens) per chunk
    (4, 1, 32, 4, [(0, 2), (3, 200)]),
    (6, 6, 80, 1, [(5, 17)]),
    (8, 2, 128, 16, [(0, 300)]),
    (14, 2, 64, 16, [(33, 50), (0, 97)]),                  # 7 query heads per kv head
])
def test_prefill_kernel_matches_sdpa_over_scattered_blocks(lib, heads, kv_heads, head_dim, block_size, chunks,
                                                            monkeypatch):
    rng = random.Random(heads * 1000 + head_dim)
    torch.manual_seed(rng.randrange(1 << 30))
    n_q, starts = torch.tensor([n for _, n in chunks]), torch.tensor([s for s, _ in chunks])
    width = max(-(-(s + n) // block_size) for s, n in chunks) + 1
    num_blocks = len(chunks) * width + 3
    k_layer = torch.randn(kv_heads, num_blocks, block_size, head_dim)
    v_layer = torch.randn(kv_heads, num_blocks, block_size, head_dim)
    ids = list(range(num_blocks))
    rng.shuffle(ids)
    tables = torch.tensor(ids[:len(chunks) * width]).view(len(chunks), width)
    q_rows = torch.cumsum(torch.cat([torch.tensor([2]), n_q[:-1]]), 0)     # chunks after 2 other rows
    rows = int(q_rows[-1] + n_q[-1]) + 2
    q = torch.randn(rows, heads + kv_heads, head_dim)[:, :heads]           # strided, as the model has them
    out = torch.full((rows, heads * head_dim), float("nan"))
    cpu_kernels.prefill_attention(lib, q, k_layer, v_layer, tables, q_rows, n_q, starts, out, head_dim ** -0.5)
    ref = reference_prefill_attention(q, k_layer, v_layer, tables, q_rows, n_q, starts, head_dim ** -0.5)
    mine = ~ref.isnan()
    assert (out[mine] - ref[mine]).abs().max() < 1e-5
    assert out[~mine].isnan().all()                                          # other rows untouched
    # with a scratch cap smaller than one chunk's keys, every chunk goes in a call of its own: same result
    monkeypatch.setattr(cpu_kernels, "PREFILL_SCRATCH_BYTES", 1)
    again = torch.full_like(out, float("nan"))
    cpu_kernels.prefill_attention(lib, q, k_layer, v_layer, tables, q_rows, n_q, starts, again, head_dim ** -0.5)
    assert torch.equal(again[mine], out[mine]) and again[~mine].isnan().all()
    monkeypatch.undo()
    # scores of +-1e4 overflow a naive exp; the kernel subtracts each row's maximum first
    cpu_kernels.prefill_attention(lib, q * 400, k_layer, v_layer, tables, q_rows, n_q, starts, out, 1.0)
    ref = reference_prefill_attention(q * 400, k_layer, v_layer, tables, q_rows, n_q, starts, 1.0)
    assert out[mine].isfinite().all() and (out[mine] - ref[mine]).abs().max() < 1e-3


def test_decode_kernel_softmax_is_stable_for_large_scores(lib):
    # scores of +-1e4 overflow a naive exp; the kernel subtracts the row maximum first
    k_layer = torch.zeros(1, 2, 4, 8)
    v_layer = torch.arange(64, dtype=torch.float32).view(1, 2, 4, 8)
    k_layer[0, 1, 1, 0] = 1.0                                         # key 5 of the sequence below
    q = torch.zeros(1, 1, 8)
    q[0, 0, 0] = 1e4
    out = torch.empty(1, 8)
    cpu_kernels.paged_decode_attention(lib, q, k_layer, v_layer, torch.tensor([[0, 1]]), torch.tensor([7]), 7,
                                       out, 1.0)
    assert torch.equal(out[0], v_layer[0, 1, 1])                     # all weight on key 5, no NaN


@pytest.mark.parametrize("rows,dim", [(1, 8), (7, 64), (300, 512), (33, 80)])
def test_rms_norm_kernel_matches_f_rms_norm_with_and_without_the_residual_add(lib, rows, dim):
    torch.manual_seed(rows * dim)
    weight, eps = torch.randn(dim), 1e-5
    base = torch.randn(rows, dim + 3) * 5
    x = base[:, :dim]                                                  # strided rows, as x[r] slices are
    expected = F.rms_norm(x, (dim,), weight, eps)
    assert (cpu_kernels.rms_norm(lib, x, weight, eps) - expected).abs().max() < 1e-5
    assert torch.equal(base[:, :dim], x)                               # x untouched without a delta
    delta = torch.randn(rows, dim)
    summed = x + delta
    out = cpu_kernels.rms_norm(lib, x, weight, eps, delta)
    assert (x - summed).abs().max() < 1e-6                             # the residual was updated in place
    assert (out - F.rms_norm(summed, (dim,), weight, eps)).abs().max() < 1e-5
    with pytest.raises(ValueError, match="a delta shaped like x"):
        cpu_kernels.rms_norm(lib, x, weight, eps, delta[:, :dim - 1])


def test_write_kv_kernel_matches_index_copy(lib):
    torch.manual_seed(3)
    kv_heads, blocks, block_size, hd, rows = 4, 30, 16, 64, 70
    qkv = torch.randn(rows, (8 + 2 * kv_heads) * hd)                     # k and v are strided views, as in the model
    k = qkv[:, 8 * hd:(8 + kv_heads) * hd].view(rows, kv_heads, hd)
    v = qkv[:, (8 + kv_heads) * hd:].view(rows, kv_heads, hd)
    slots = torch.randperm(blocks * block_size)[:rows]
    pool = torch.randn(2, kv_heads, blocks, block_size, hd)
    expected = pool.clone()
    expected[0].view(kv_heads, -1, hd).index_copy_(1, slots, k.transpose(0, 1))
    expected[1].view(kv_heads, -1, hd).index_copy_(1, slots, v.transpose(0, 1))
    cpu_kernels.write_kv(lib, k, v, slots, pool[0], pool[1])
    assert torch.equal(pool, expected)                                    # written slots, and nothing else
    with pytest.raises(ValueError, match="slots"):
        cpu_kernels.write_kv(lib, k, v, slots + blocks * block_size, pool[0], pool[1])


@pytest.mark.parametrize("rows,heads,head_dim", [(1, 1, 8), (5, 12, 64), (300, 3, 128)])
def test_rope_kernel_matches_the_model_rotation_in_place(lib, rows, heads, head_dim):
    from tokenfleet_serving.engine.layers.rotary_embedding import RotaryEmbedding
    torch.manual_seed(rows)
    freqs = torch.outer(torch.arange(400, dtype=torch.float32), torch.rand(head_dim // 2))
    cos = torch.cat((freqs.cos(), freqs.cos()), dim=-1)
    sin = torch.cat((-freqs.sin(), freqs.sin()), dim=-1)
    positions = torch.randint(0, 400, (rows,))
    rows_of = torch.randn(rows, heads + 2, head_dim)                      # rotate the first heads of wider rows
    x = rows_of[:, :heads]
    expected = RotaryEmbedding.rotate(x, cos[positions].unsqueeze(1), sin[positions].unsqueeze(1))
    untouched = rows_of[:, heads:].clone()
    cpu_kernels.rope_(lib, x, cos, sin, positions)
    assert torch.allclose(x, expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(rows_of[:, heads:], untouched)


@pytest.mark.parametrize("rows,inter", [(1, 8), (3, 13), (64, 1376), (300, 40)])
def test_silu_mul_kernel_matches_torch(lib, rows, inter):
    torch.manual_seed(rows + inter)
    gate_up = torch.randn(rows, 2 * inter) * 6                            # both signs, |x| up to ~25
    gate_up[0, 0], gate_up[-1, inter - 1] = -100.0, 100.0                 # far tails: 0 and x itself
    gate, up = gate_up.chunk(2, dim=-1)
    expected = F.silu(gate) * up
    got = cpu_kernels.silu_mul(lib, gate_up)
    assert got.shape == (rows, inter)
    assert torch.allclose(got, expected, rtol=1e-6, atol=1e-6)


def test_kernel_library_is_cached_by_source_and_rebuilt_when_it_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENFLEET_KERNEL_CACHE", str(tmp_path / "cache"))
    first = cpu_kernels.build()
    assert first.parent == tmp_path / "cache" and first.exists()
    stamp = first.stat().st_mtime_ns
    assert cpu_kernels.build() == first and first.stat().st_mtime_ns == stamp    # not rebuilt
    changed = tmp_path / "cpu_kernels.c"
    changed.write_text(cpu_kernels.SOURCE.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", changed)
    second = cpu_kernels.build()
    assert second != first and second.exists()
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == sorted([first.name, second.name])


def test_broken_source_or_missing_compiler_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENFLEET_KERNEL_CACHE", str(tmp_path))
    broken = tmp_path / "broken.c"
    broken.write_text("void tf_rms_norm( {\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE", broken)
    with pytest.raises(cpu_kernels.KernelUnavailable, match="compiling broken.c failed"):
        cpu_kernels.build()
    assert [p.name for p in tmp_path.iterdir()] == ["broken.c"]        # no half-written library left
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(cpu_kernels.KernelUnavailable, match="no C compiler"):
        cpu_kernels.build()


def test_a_build_without_avx2_keeps_every_kernel_correct_on_its_portable_paths(tmp_path, monkeypatch):
    """Without AVX2 + FMA (an older x86 or an Arm CPU) the GEMM and the prefill attention are compiled out and
    the engine uses oneDNN and SDPA for them; the other kernels run their portable loops, which must agree
    with torch too."""
    import ctypes

    monkeypatch.setenv("TOKENFLEET_KERNEL_CACHE", str(tmp_path))
    flags = [f for f in cpu_kernels.compile_flags() if not f.startswith("-march")]
    monkeypatch.setattr(cpu_kernels, "compile_flags", lambda: flags)
    portable = cpu_kernels.bind(ctypes.CDLL(str(cpu_kernels.build())))
    assert portable.tf_gemm_available() == 0 and not cpu_kernels.prefill_attends(portable, 64)
    weight = torch.randn(32, 24)
    lin = Linear(weight, None, True, portable)
    assert lin.panels is None and lin.packed is not None                   # oneDNN takes the linears
    torch.manual_seed(5)
    gate_up = torch.randn(7, 2 * 40) * 6
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.allclose(cpu_kernels.silu_mul(portable, gate_up), F.silu(gate) * up, rtol=1e-6, atol=1e-6)
    x, w = torch.randn(9, 48), torch.randn(48)
    assert torch.allclose(cpu_kernels.rms_norm(portable, x.clone(), w, 1e-6), F.rms_norm(x, (48,), w, 1e-6),
                          rtol=1e-5, atol=1e-6)
    kv_heads, blocks, block_size, hd = 2, 12, 4, 16
    k_layer, v_layer = torch.randn(kv_heads, blocks, block_size, hd), torch.randn(kv_heads, blocks, block_size, hd)
    tables, lens = torch.randperm(blocks)[:8].view(2, 4), torch.tensor([5, 16])
    q, out = torch.randn(2, 4, hd), torch.empty(2, 4 * hd)
    cpu_kernels.paged_decode_attention(portable, q, k_layer, v_layer, tables, lens, 16, out, hd ** -0.5)
    assert (out - reference_decode_attention(q, k_layer, v_layer, tables, lens, hd ** -0.5)).abs().max() < 1e-5
    kv_rows = torch.randn(3, 2 * kv_heads, hd)
    slots = torch.tensor([0, 17, 40])
    expected = k_layer.clone()
    expected.view(kv_heads, -1, hd).index_copy_(1, slots, kv_rows[:, :kv_heads].transpose(0, 1))
    cpu_kernels.write_kv(portable, kv_rows[:, :kv_heads], kv_rows[:, kv_heads:], slots, k_layer, v_layer)
    assert torch.equal(k_layer, expected)


def test_a_prebuilt_library_needs_no_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENFLEET_KERNEL_CACHE", str(tmp_path))
    built = cpu_kernels.build()                         # as the image's build stage does
    monkeypatch.setattr(cpu_kernels.shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    assert cpu_kernels.build() == built                 # as the compiler-less final image does


def test_load_falls_back_to_pytorch_when_switched_off_or_unbuildable(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TOKENFLEET_KERNEL_CACHE", str(tmp_path))          # nothing prebuilt here
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv("TOKENFLEET_CPU_KERNELS", "0")
    assert cpu_kernels.load() is None
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.delenv("TOKENFLEET_CPU_KERNELS")
    monkeypatch.setenv("CC", "/nonexistent/cc")
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.load() is None
    assert "using the PyTorch attention path" in caplog.text and "/nonexistent/cc" in caplog.text


def test_engine_without_kernels_uses_the_pytorch_path(llama_dir, monkeypatch):
    from tokenfleet_serving.engine import LLMEngine, SamplingParams

    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.setenv("TOKENFLEET_CPU_KERNELS", "0")
    off = LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=1 << 20, block_size=4)
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    monkeypatch.delenv("TOKENFLEET_CPU_KERNELS")
    on = LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=1 << 20, block_size=4)
    assert off.runner.kernels is None and on.runner.kernels is not None
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    prompts = [[5 + i, 9, 11 + 2 * i] * (i + 1) for i in range(6)]
    assert [o.new_token_ids for o in off.generate(prompts, params)] == \
           [o.new_token_ids for o in on.generate(prompts, params)]


# ---- Linear ------------------------------------------------------------------------
@pytest.mark.parametrize("path", ["gemm", "onednn", "aten"])
def test_linear_matches_f_linear_for_any_row_count(path, lib):
    if path == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.fail("this torch build has no oneDNN: the CPU fast path cannot run")
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 40), torch.randn(96)
    kernels = lib if path == "gemm" else None
    lin, lin_nobias = Linear(weight, bias, path == "onednn", kernels), Linear(weight, None, path == "onednn", kernels)
    assert (lin.panels is not None) == (path == "gemm") and (lin.packed is not None) == (path == "onednn")
    for rows in [1, 3, 5, 6, 7, 8, 9, 63, 64, 255, 256, 257, 511, 700, 2300, 4100]:
        for x in (torch.randn(rows, 80)[:, ::2], torch.randn(rows, 50)[:, 5:45]):   # strided columns, strided rows
            assert lin(x).shape == (rows, 96)
            assert (lin(x) - F.linear(x, weight, bias)).abs().max() < 1e-4
            assert (lin_nobias(x) - F.linear(x, weight)).abs().max() < 1e-4


def test_gemm_rows_do_not_depend_on_their_batch(lib):
    """Each output of the packed GEMM is a plain k-ordered sum: a row's result is bitwise the same alone,
    at any position of a batch, and in a batch of any size (so batching never changes a greedy token)."""
    torch.manual_seed(1)
    lin = Linear(torch.randn(64, 1376), None, False, lib)
    x = torch.randn(300, 1376)
    full = lin(x)
    for i in (0, 5, 6, 131, 299):
        assert torch.equal(lin(x[i:i + 1])[0], full[i])
        assert torch.equal(lin(x[i - 3 if i >= 3 else 0:i + 9])[min(i, 3)], full[i])


def test_linear_uses_the_gemm_only_for_multiples_of_16_outputs(lib):
    assert Linear(torch.randn(32, 8), None, True, lib).panels is not None
    weight = torch.randn(40, 8)
    odd = Linear(weight, None, True, lib)                                # 40 outputs: oneDNN instead
    assert odd.panels is None and odd.packed is not None
    x = torch.randn(3, 8)
    assert (odd(x) - F.linear(x, weight)).abs().max() < 1e-4


def test_linear_hands_onednn_at_most_40_row_counts(monkeypatch):
    """oneDNN compiles and keeps a primitive per input shape; padding and pieces bound the row counts."""
    seen = set()
    real = torch.ops.mkldnn._linear_pointwise

    def spy(x, *args):
        seen.add(x.shape[0])
        return real(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    lin = Linear(torch.randn(16, 8), None, True)
    for rows in list(range(1, 1100)) + list(range(1100, 9000, 37)):
        lin(torch.randn(rows, 8))
    assert seen == set(range(8, Linear.SMALL + 1, 8)) | set(range(2 * Linear.SMALL, Linear.PIECE + 1, Linear.SMALL))
    assert len(seen) == 39


def _anon_huge_kb(address: int) -> int:
    """AnonHugePages (kB) of this process's mapping that holds ``address``, from /proc/self/smaps."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            start, end = (int(x, 16) for x in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_the_kv_pool_is_zeroed_and_backed_by_huge_pages_where_linux_allows(llama_dir):
    from pathlib import Path

    from tokenfleet_serving.engine import LLMEngine

    eng = LLMEngine.from_pretrained(llama_dir, dtype="float32", device="cpu", kv_cache_bytes=32 << 20)
    pool = eng.runner.kv_pool
    assert pool.numel() * 4 >= 16 << 20 and not pool.any()           # zeroed, as torch.zeros was
    assert pool.data_ptr() % (2 << 20) == 0 and pool.is_contiguous()
    pool[-1, -1, -1, -1, -1, -1] = 7.0                                 # writable to its last float
    assert pool.sum() == 7.0
    pool[-1, -1, -1, -1, -1, -1] = 0.0
    mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    if "[never]" not in mode:   # madvise or always: the scattered 4 KB blocks sit in 2 MB pages
        assert _anon_huge_kb(pool.data_ptr() + pool.numel() * 2) >= 2048
