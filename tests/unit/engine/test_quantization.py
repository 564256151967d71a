"""Weight-only int8: the quantizer, the int8 GEMM kernel (AVX2 and portable builds) against its torch
definition, the engine over int8 weights against the fp32 engine over the same weights dequantized, and the
errors for quantizations and checkpoints the engine cannot take."""
from __future__ import annotations

import ctypes
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from tokenfleet_serving.engine import LLMEngine, SamplingParams, cpu_kernels, dtype_choice
from tokenfleet_serving.engine.batch import SeqChunk, build_batch
from tokenfleet_serving.engine.config import CheckpointError
from tokenfleet_serving.engine.loader import load_checkpoint, load_config
from tokenfleet_serving.engine.model_runner import ModelRunner
from tokenfleet_serving.engine.quantization import Int8Linear, QuantizationError, parse_quantization, quantize_int8

QUANTIZED = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
             "up_proj.weight", "down_proj.weight", "lm_head.weight")


@pytest.fixture(scope="module")
def lib():
    lib = cpu_kernels.load()
    assert lib is not None, "the C kernels did not build (is gcc installed? hack/setup.sh installs it)"
    return lib


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """The kernel library built without AVX2 + FMA (an older x86 or an Arm host)."""
    import pytest as _pytest
    mp = _pytest.MonkeyPatch()
    mp.setenv("TOKENFLEET_KERNEL_CACHE", str(tmp_path_factory.mktemp("portable")))
    flags = [f for f in cpu_kernels.compile_flags() if not f.startswith("-march")]
    mp.setattr(cpu_kernels, "compile_flags", lambda: flags)
    lib = cpu_kernels.bind(ctypes.CDLL(str(cpu_kernels.build())))
    mp.undo()
    assert lib.tf_gemm_available() == 0
    return lib


def reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (x.double() @ q.double().T * scale.double()).float()


def test_quantize_int8_is_symmetric_per_output_channel():
    torch.manual_seed(0)
    w = torch.randn(48, 100) * torch.logspace(-3, 1, 48)[:, None]     # rows of very different magnitudes
    w[5] = 0.0                                                        # an all-zero channel
    q, scale = quantize_int8(w.bfloat16(), "w")
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (48,)
    assert int(q.abs().max()) == 127 and int(q[5].abs().max()) == 0 and float(scale[5]) == 1.0
    src = w.bfloat16().float()
    top = src.abs().amax(dim=1)
    live = top > 0
    assert torch.allclose(scale[live], top[live] / 127)
    assert (q.abs().amax(dim=1)[live] == 127).all()                    # every channel uses its full range
    err = (q.float() * scale[:, None] - src).abs()
    assert (err <= scale[:, None] / 2 * (1 + 1e-5)).all()              # rounding: at most half a step


def test_quantize_int8_refuses_weights_it_cannot_represent():
    with pytest.raises(QuantizationError, match="layers.0.mlp.down_proj.weight: .*inf or NaN"):
        quantize_int8(torch.tensor([[1.0, float("nan")]]), "layers.0.mlp.down_proj.weight")
    with pytest.raises(QuantizationError, match="2-d float"):
        quantize_int8(torch.ones(4, 4, dtype=torch.int8), "w")


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("k", [40, 64, 100, 1376])
def test_int8_gemm_matches_its_definition_for_any_row_count(build, k, lib, portable):
    kernels = lib if build == "native" else portable
    torch.manual_seed(k)
    q = torch.randint(-127, 128, (96, k), dtype=torch.int8)
    scale = torch.rand(96) * 0.01
    panels = cpu_kernels.pack_weight_int8(q)
    for rows in (1, 2, 5, 6, 7, 13, 15, 16, 17, 40, 300):
        for x in (torch.randn(rows, k), torch.randn(rows, 2 * k)[:, ::2]):        # contiguous and strided
            y = cpu_kernels.linear_int8(kernels, x, panels, scale)
            ref = reference(x, q, scale)
            assert y.shape == (rows, 96)
            assert (y - ref).abs().max() <= 1e-5 * ref.abs().max(), (rows, k)


@pytest.mark.parametrize("build", ["native", "portable"])
def test_int8_gemm_rows_do_not_depend_on_their_batch(build, lib, portable):
    """Both AVX2 strategies (int8 tiles below 16 rows, widened panels above) do the same operations in the
    same order: a row's result is bitwise the same alone and in any batch, so speculative verification and
    batching never change a greedy token of an int8 model."""
    kernels = lib if build == "native" else portable
    torch.manual_seed(3)
    q, scale = torch.randint(-127, 128, (64, 512), dtype=torch.int8), torch.rand(64)
    panels = cpu_kernels.pack_weight_int8(q)
    x = torch.randn(300, 512)
    full = cpu_kernels.linear_int8(kernels, x, panels, scale)
    for i in (0, 5, 6, 15, 16, 131, 299):
        assert torch.equal(cpu_kernels.linear_int8(kernels, x[i:i + 1], panels, scale)[0], full[i])
        lo = max(i - 3, 0)
        for width in (4, 12, 20, 64):
            assert torch.equal(cpu_kernels.linear_int8(kernels, x[lo:lo + width], panels, scale)[i - lo], full[i])


@pytest.mark.parametrize("path", ["kernels", "torch-fp32", "torch-bf16"])
def test_int8_linear_matches_its_dequantized_weight(path, lib):
    torch.manual_seed(4)
    weight, bias = torch.randn(40, 64) * 0.05, torch.randn(40)          # 40 outputs: padded panels
    q, scale = quantize_int8(weight)
    dequantized = q.float() * scale[:, None]
    dtype = torch.bfloat16 if path == "torch-bf16" else torch.float32
    lin = Int8Linear(weight, bias.to(dtype), lib if path == "kernels" else None, dtype, torch.device("cpu"))
    assert (lin.panels is not None) == (path == "kernels") and lin.padded == (path == "kernels")
    for rows in (1, 3, 16, 17, 50):
        x = torch.randn(rows, 64)
        y = lin(x.to(dtype)).float()
        ref = x @ dequantized.T + bias
        tolerance = 1e-4 if dtype == torch.float32 else 0.05 * float(ref.abs().max())
        assert y.shape == (rows, 40) and (y - ref).abs().max() <= tolerance, rows


def dequantized_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = dict(weights)
    for name, t in weights.items():
        if name.endswith(QUANTIZED):
            q, scale = quantize_int8(t, name)
            out[name] = q.float() * scale[:, None]
    return out


def linear_bytes(model: ModelRunner) -> int:
    """Bytes of the decoder's linear weights, however each is kept."""
    total = 0
    for layer in model.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = layer.linears()[name]
            if isinstance(lin, Int8Linear):
                total += lin.weight_bytes
            else:
                kept = next(t for t in (lin.panels, lin.packed, lin.weight) if t is not None)
                total += kept.numel() * kept.element_size()
    return total


def step_logits(model: ModelRunner, bs: int = 4) -> torch.Tensor:
    """Logits of every row of a step with two prompts, then of a step with their decodes and a chunk."""
    model.allocate_kv_cache(64, bs)
    a, b = list(range(5, 30)), list(range(40, 47))
    first = model.forward(build_batch([SeqChunk(a[:20], 0, list(range(0, 8)), True),
                                       SeqChunk(b[:3], 0, list(range(8, 10)), True)],
                                      bs, model.device, model.compiled_prefill), all_logits=True)
    second = model.forward(build_batch([SeqChunk(a[20:21], 20, list(range(0, 8)), True),
                                        SeqChunk(b[3:7], 3, list(range(8, 10)), True)],
                                       bs, model.device, model.compiled_prefill), all_logits=True)
    return torch.cat([first, second])


@pytest.mark.parametrize("kernels", [True, False], ids=["c-kernels", "torch"])
@pytest.mark.parametrize("name", ["llama", "qwen2", "llama-biases"])       # no biases, q/k/v biases, every bias
def test_int8_model_is_the_fp32_model_over_the_dequantized_weights(name, kernels, checkpoints):
    ckpt = load_checkpoint(checkpoints[name], with_tokenizer=False)
    cpu = torch.device("cpu")
    int8 = ModelRunner(ckpt.config, ckpt.weights, torch.float32, cpu, 128, use_kernels=kernels, quantization="int8")
    plain = ModelRunner(ckpt.config, dequantized_weights(ckpt.weights), torch.float32, cpu, 128, use_kernels=kernels)
    assert all(isinstance(layer.linears()[n], Int8Linear) for layer in int8.layers for n in ("qkv", "o", "gate_up", "down"))
    assert isinstance(int8.lm_head.matmul, Int8Linear) and not ckpt.config.tie_word_embeddings
    got, want = step_logits(int8), step_logits(plain)
    assert (got - want).abs().max() < 1e-4
    assert linear_bytes(int8) < 0.3 * linear_bytes(plain)                        # a byte per weight plus the scales
    assert int8.weight_bytes() < plain.weight_bytes() - 0.7 * linear_bytes(plain)


@pytest.mark.parametrize("name", ["llama", "llama3-tied", "llama-biases"])
def test_int8_one_call_decoder_layers_give_the_layer_loops_bits(name, checkpoints):
    ckpt = load_checkpoint(checkpoints[name], with_tokenizer=False)
    model = ModelRunner(ckpt.config, ckpt.weights, torch.float32, torch.device("cpu"), 128, quantization="int8")
    results = {}
    for fused in (False, True):
        model.use_decoder_call = fused
        results[fused] = step_logits(model)
    # the one call exists wherever the prefill kernel does (AVX2 builds); elsewhere both runs are the loop
    assert (model.decoder_call is not None) == cpu_kernels.prefill_attends(model.kernels, ckpt.config.head_dim)
    assert torch.equal(results[False], results[True])


def test_engine_serves_int8_and_reports_smaller_weights(llama_dir):
    fp32 = LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=4 << 20)
    int8 = LLMEngine.from_pretrained(llama_dir, dtype="float32", kv_cache_bytes=4 << 20, quantization="int8")
    assert int8.quantization == "int8"
    assert (int8.runner.decoder_call is not None) == (fp32.runner.decoder_call is not None)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    [out] = int8.generate([[5, 6, 7, 8]], params)
    assert len(out.new_token_ids) == 8 and out.finish_reason == "length"
    assert int8.runner.weight_bytes() < fp32.runner.weight_bytes()


def test_quantization_names_are_checked():
    assert parse_quantization("int8") == "int8" and parse_quantization(None) == "none"
    for name in ("fp8", "awq", "gptq"):
        with pytest.raises(QuantizationError, match=f"--quantization: {name} is not implemented"):
            parse_quantization(name, "--quantization")
    with pytest.raises(QuantizationError, match="quantization must be one of none, int8"):
        parse_quantization("int4")


def test_a_prequantized_checkpoint_is_refused_naming_the_field(llama_dir, tmp_path):
    bad = tmp_path / "gptq"
    shutil.copytree(llama_dir, bad)
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (bad / "config.json").write_text(json.dumps(config))
    for quantization in ("none", "int8"):
        with pytest.raises(CheckpointError, match=r"config\.json: field 'quantization_config.quant_method' = 'gptq'"):
            LLMEngine.from_pretrained(bad, dtype="float32", quantization=quantization)


def test_integer_tensors_are_refused_naming_file_and_tensor(llama_dir, tmp_path):
    bad = tmp_path / "int-weights"
    shutil.copytree(llama_dir, bad)
    [path] = sorted(bad.glob("*.safetensors"))
    tensors = load_file(str(path))
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.mlp.up_proj.weight"].to(torch.int8)
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=rf"{path.name}: tensor 'model.layers.0.mlp.up_proj.weight' is torch.int8"):
        LLMEngine.from_pretrained(bad, dtype="float32", quantization="int8")


def test_dtype_auto_measures_the_candidates_with_int8_weights(llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENFLEET_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setattr(dtype_choice, "PROBE_ROUNDS", 1)          # the probe's speed is not what is tested
    monkeypatch.setattr(dtype_choice, "PROBE_DECODES", 2)
    config = load_config(llama_dir)
    built = []
    real = ModelRunner.__init__

    def spy(self, *args, **kwargs):
        built.append(kwargs.get("quantization"))
        real(self, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "__init__", spy)
    choice = dtype_choice.choose_dtype("auto", torch.device("cpu"), config, True, "int8")
    assert built == ["int8", "int8"] and choice.how == "measured"
    assert set(choice.probe_tokens_per_second) == {"float32", "bfloat16"}
    key = lambda q: dtype_choice._cache_key(config, dtype_choice.cpu_candidates(), True, q)
    assert key("int8") != key("none")
    again = dtype_choice.choose_dtype("auto", torch.device("cpu"), config, True, "int8")
    assert again.how == "cached" and again.dtype == choice.dtype
