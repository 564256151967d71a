"""Small Llamas that really copy from their prompt, for W5 (extractive requests).

Random weights never copy, so prompt lookup would never be accepted on them. Two ways to get a model that
does, both saved in Hugging Face format with the byte-level test tokenizer, so the engine loads them like
any checkpoint:

* ``build``: the benchmark's default. A two-layer Llama whose weights are set to an induction circuit, the
  mechanism trained transformers use to copy (see its docstring): deterministic, and instant.
* ``train``: a two-layer Llama trained (seeded, for a given time) on a synthetic extractive task: a prompt is
  a "document" of random tokens and a separator; the answer is a few spans of the document, then EOS. The
  first token of each span cannot be predicted; the rest can, by finding the previous token in the
  document and continuing. On a quiet 2-core host this takes minutes to learn; on the shared host of this
  work (load average 8-13) 4 minutes gave 74 steps and no learning, so the benchmark builds by default.

``prompts`` gives W5's prompts: fresh documents and the separator; the models write the answers.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

SEP_TOKEN = "<|im_start|>"     # between the document and the answer (a special token of the test tokenizer)
EOS_TOKEN = "<|im_end|>"


# The reference model's vocabulary (bench engine's REFERENCE), so that W5's model has its size, lm_head included,
# and a document of random tokens repeats few of them (an induction circuit copies "what followed this token
# before", which a token seen twice leaves ambiguous; a trained model would read more context).
VOCAB_SIZE = 8192


@dataclass(frozen=True)
class CopyTask:
    vocab_size: int = VOCAB_SIZE
    first_content_id: int = 16           # document tokens are drawn from [first_content_id, vocab_size)
    doc_min: int = 48
    doc_max: int = 96
    spans_min: int = 1
    spans_max: int = 3
    span_min: int = 12
    span_max: int = 32


@dataclass(frozen=True)
class CopyModelShape:
    num_layers: int = 2
    hidden_size: int = 128
    num_heads: int = 4
    num_kv_heads: int = 4
    intermediate_size: int = 256


# The benchmark's documents (training uses shorter ones), uniform over the vocabulary. (With Zipf-distributed
# tokens the circuit falls into repeating the commonest one, which no extractive answer does.)
W5 = CopyTask(doc_min=96, doc_max=160)
TARGET = CopyModelShape()
DRAFT = CopyModelShape(num_layers=2, hidden_size=64, num_heads=2, num_kv_heads=2, intermediate_size=128)


def special_ids(vocab_size: int) -> tuple[int, int]:
    from ..testing_models import build_tokenizer

    tok = build_tokenizer(vocab_size)
    return tok.token_to_id(SEP_TOKEN), tok.token_to_id(EOS_TOKEN)


def example(task: CopyTask, gen: torch.Generator, sep: int, eos: int) -> tuple[list[int], list[int]]:
    """(prompt, answer): a document then the separator; spans of the document then EOS."""
    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    doc = torch.randint(task.first_content_id, task.vocab_size, (randint(task.doc_min, task.doc_max),),
                        generator=gen).tolist()
    answer: list[int] = []
    for _ in range(randint(task.spans_min, task.spans_max)):
        length = randint(task.span_min, min(task.span_max, len(doc) - 1))
        start = randint(0, len(doc) - length)
        answer += doc[start:start + length]
    return doc + [sep], answer + [eos]


def batch(task: CopyTask, gen: torch.Generator, size: int, sep: int, eos: int
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, labels with -100 outside the answers, attention mask), right-padded."""
    pairs = [example(task, gen, sep, eos) for _ in range(size)]
    width = max(len(p) + len(a) for p, a in pairs)
    ids = torch.full((size, width), eos, dtype=torch.long)
    labels = torch.full((size, width), -100, dtype=torch.long)
    mask = torch.zeros((size, width), dtype=torch.long)
    for i, (p, a) in enumerate(pairs):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        labels[i, len(p):n] = torch.tensor(a)
        mask[i, :n] = 1
    return ids, labels, mask


def train(directory: str | Path, shape: CopyModelShape = TARGET, task: CopyTask = CopyTask(), *, seed: int = 0,
          seconds: float = 180.0, max_steps: int = 100_000, batch_size: int = 16, lr: float = 3e-3,
          log=print) -> dict:
    """Train a copy model for ``seconds`` (or ``max_steps``) and save it to ``directory``; returns what was
    done (steps, seconds, final loss, answer-token accuracy on held-out examples)."""
    import transformers

    from ..testing_models import CHAT_TEMPLATE, build_tokenizer

    torch.manual_seed(seed)
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(task.vocab_size)
    sep, eos = tok.token_to_id(SEP_TOKEN), tok.token_to_id(EOS_TOKEN)
    config = transformers.LlamaConfig(
        vocab_size=task.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, max_position_embeddings=1024, bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=eos, pad_token_id=tok.token_to_id("<unk>"), tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    gen = torch.Generator().manual_seed(seed)
    warmup = 50
    started = time.perf_counter()
    step, loss_value = 0, math.nan
    while step < max_steps and time.perf_counter() - started < seconds:
        ids, labels, mask = batch(task, gen, batch_size, sep, eos)
        for group in opt.param_groups:
            group["lr"] = lr * min(1.0, (step + 1) / warmup)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        loss_value = float(loss.detach())
        if step % 50 == 0:
            log(f"copy model {shape.hidden_size}x{shape.num_layers}: step {step}, loss {loss_value:.3f}, "
                f"{time.perf_counter() - started:.0f} s")
    elapsed = time.perf_counter() - started
    model.eval()
    accuracy = answer_accuracy(model, task, torch.Generator().manual_seed(seed + 1), sep, eos)
    model.save_pretrained(directory, safe_serialization=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": EOS_TOKEN, "unk_token": "<unk>",
        "pad_token": "<unk>", "add_bos_token": False, "model_max_length": 1024, "chat_template": CHAT_TEMPLATE},
        indent=2))
    report = {"how": "trained", "steps": step, "seconds": round(elapsed, 1), "final_loss": round(loss_value, 4),
              "answer_token_accuracy": round(accuracy, 4), "seed": seed, "shape": asdict(shape), "task": asdict(task),
              "batch_size": batch_size, "lr": lr}
    (directory / "copy_task.json").write_text(json.dumps(report, indent=2))
    return report


@torch.inference_mode()
def answer_accuracy(model, task: CopyTask, gen: torch.Generator, sep: int, eos: int, n: int = 64) -> float:
    """Share of answer tokens (after the first of each span, which no model can know) the model's argmax gets
    right, teacher-forced, on fresh examples."""
    ids, labels, mask = batch(task, gen, n, sep, eos)
    logits = model(input_ids=ids, attention_mask=mask).logits
    predicted = logits[:, :-1].argmax(-1)
    target = labels[:, 1:]
    valid = target != -100
    return float((predicted[valid] == target[valid]).float().mean())


def prompts(task: CopyTask, count: int, seed: int) -> list[list[int]]:
    """W5's prompts: fresh documents of the task (the answers are the model's to write)."""
    sep, eos = special_ids(task.vocab_size)
    gen = torch.Generator().manual_seed(seed)
    return [example(task, gen, sep, eos)[0] for _ in range(count)]


# ---- the copying model built by hand ---------------------------------------------------------------------
@dataclass(frozen=True)
class CircuitShape:
    """A Llama whose first two layers' weights are set to an induction circuit (``build``), followed by
    ``filler_layers`` layers of random weights that compute like any layer but write only residual dimensions
    the circuit leaves alone, so the model costs what a model of its size costs and still copies."""
    hidden_size: int = 256
    head_dim: int = 128
    code_dim: int = 64            # dimensions of the random code that identifies a token
    seed: int = 0
    filler_layers: int = 0
    intermediate_size: int = 16


# The target has the reference model's size (8 layers, hidden 512, MLP 1,376: 25 M linear weights), so that a
# decoding step costs what it costs there: speculation pays by saving steps whose weights must be read, which
# a model of a few hundred thousand weights never shows. The draft is the bare two-layer circuit, ~100x cheaper.
CIRCUIT_TARGET = CircuitShape(hidden_size=512, filler_layers=6, intermediate_size=1376)
CIRCUIT_DRAFT = CircuitShape(hidden_size=128, head_dim=64, code_dim=32, seed=1)
PREVIOUS_TOKEN_PAIRS = 8          # the fastest-turning rotary pairs: they single out the previous position
ROPE_THETA = 1e7                  # slow pairs barely turn over a thousand positions: they match content


def build(directory: str | Path, shape: CircuitShape = CIRCUIT_TARGET, vocab_size: int = VOCAB_SIZE) -> dict:
    """Write a Llama checkpoint whose first two layers copy from the context, by construction (an induction circuit,
    as trained transformers form): every token has a random unit code; layer 1's first head attends from
    each position to the one before it (constant queries and keys, through their biases, on the fastest
    rotary frequencies) and writes the previous token's code next to the current one; layer 2's first head
    compares the current token's code with every position's previous-token code (on the slowest rotary
    frequencies, which hardly turn) and copies the code of the token that followed the best match; the
    lm_head reads that code back as logits. It predicts "what came after this token last time", and nothing
    else: where the current token never occurred before, its guess is arbitrary. The filler layers after them
    (``CircuitShape``) give the model its size and change no greedy token. Every weight is a plain
    Llama weight (with attention_bias), so the engine and transformers run it as they run any checkpoint."""
    import transformers

    from ..testing_models import CHAT_TEMPLATE, build_tokenizer

    D, hd, c = shape.hidden_size, shape.head_dim, shape.code_dim
    assert 3 * c <= D and c <= hd // 2 and hd % 2 == 0
    half = hd // 2
    gen = torch.Generator().manual_seed(shape.seed)
    codes = (torch.randint(0, 2, (vocab_size, c), generator=gen).float() * 2 - 1) / c ** 0.5   # unit vectors
    tok = build_tokenizer(vocab_size)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=D, intermediate_size=shape.intermediate_size,
        num_hidden_layers=2 + shape.filler_layers, num_attention_heads=D // hd,
        num_key_value_heads=D // hd, head_dim=hd, max_position_embeddings=1024, rope_theta=ROPE_THETA,
        attention_bias=True, rms_norm_eps=1e-6, bos_token_id=tok.token_to_id("<s>"),
        eos_token_id=tok.token_to_id(EOS_TOKEN), pad_token_id=tok.token_to_id("<unk>"), tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        a, b, out = slice(0, c), slice(c, 2 * c), slice(2 * c, 3 * c)      # residual: code, previous code, copy
        model.model.embed_tokens.weight[:, a] = codes
        norm_in = (D / 1) ** 0.5                 # RMSNorm turns a unit code (alone) into D^0.5 times it
        norm_two = (D / 2) ** 0.5                # (with the previous token's code beside it)
        freqs = ROPE_THETA ** (-torch.arange(half, dtype=torch.float64) * 2 / hd)
        first, second, *fillers = model.model.layers
        for layer in model.model.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        # filler layers: random weights throughout, but their outputs (o_proj, down_proj) only reach the
        # residual dimensions past the circuit's three codes. The final RMSNorm then scales the copy code by a
        # positive factor, which the lm_head's argmax does not see: the filler changes no greedy token.
        for layer in fillers:
            for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                        layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                lin.weight.normal_(0.0, 0.02, generator=gen)
            layer.self_attn.o_proj.weight[:3 * c] = 0.0
            layer.mlp.down_proj.weight[:3 * c] = 0.0
        # layer 1, head 0: the previous position. Constant q and k on the fast pairs, q turned by one step, so
        # q_i . k_j = s * sum cos((i - j - 1) theta): largest at j = i - 1
        attn = first.self_attn
        s = 18.0
        for i in range(PREVIOUS_TOKEN_PAIRS):
            attn.k_proj.bias[i] = s
            attn.q_proj.bias[i] = s * float(torch.cos(freqs[i]))
            attn.q_proj.bias[i + half] = -s * float(torch.sin(freqs[i]))
        attn.v_proj.weight[:c, a] = torch.eye(c) / norm_in                  # the token's code ...
        attn.o_proj.weight[b, :c] = torch.eye(c)                            # ... into the previous-code slot
        # layer 2, head 0: match the current code against previous codes on the slow pairs, copy the match's code
        attn = second.self_attn
        slow = list(range(half - c // 2, half)) + list(range(hd - c // 2, hd))      # the c slowest dimensions
        match = 9.0
        attn.q_proj.weight[slow, a] = torch.eye(c) * match / norm_two
        attn.k_proj.weight[slow, b] = torch.eye(c) * match / norm_two
        attn.v_proj.weight[:c, a] = torch.eye(c) / norm_two
        attn.o_proj.weight[out, :c] = torch.eye(c) * 2.0
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight[:, out] = codes * 6.0
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": EOS_TOKEN, "unk_token": "<unk>",
        "pad_token": "<unk>", "add_bos_token": False, "model_max_length": 1024, "chat_template": CHAT_TEMPLATE},
        indent=2))
    report = {"how": "built", "shape": asdict(shape), "vocab_size": vocab_size}
    (directory / "copy_task.json").write_text(json.dumps(report, indent=2))
    return report
