"""Create small random-weight Hugging Face checkpoints with a real tokenizer.

Used by the engine tests, the benchmark, the server tests and the local demo.
Needs ``transformers`` (a dev dependency), which writes the checkpoint exactly
as a real one is written, so loading it exercises the real formats.
"""
from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]

_WORDS = ("the a an of to in is and that for it as with on be by this are from at or was which fleet token "
          "model serve cache prefix block engine batch cluster node pod cost latency request stream "
          "kubernetes operator gpu cpu memory time first second hello world yes no what how why when "
          "one two three four five six seven eight nine ten").split()


def build_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer with exactly ``vocab_size`` tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=max(vocab_size, 300), special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = [" ".join(_WORDS[(i * 7 + j * 13) % len(_WORDS)] for j in range(12)) for i in range(400)]
    tok.train_from_iterator(corpus, trainer)
    size = tok.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer ({size} tokens)")
    tok.add_tokens([f"<extra_{i}>" for i in range(vocab_size - size)])
    assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
    return tok


def create_random_checkpoint(directory: str | Path, *, architecture: str = "llama", num_layers: int = 2,
                             hidden_size: int = 64, num_heads: int = 4, num_kv_heads: int = 2,
                             intermediate_size: int = 128, vocab_size: int = 512,
                             max_position_embeddings: int = 4096, tie_word_embeddings: bool = False,
                             rope_scaling: dict | None = None, dtype: str = "float32", seed: int = 0,
                             initializer_range: float = 0.02, max_shard_size: str | None = None,
                             linear_biases: bool = False) -> Path:
    """Write config.json, safetensors weights, tokenizer.json and tokenizer_config.json to ``directory``.
    ``linear_biases`` (Llama only) sets ``attention_bias`` and ``mlp_bias``: every linear but the lm_head has
    a bias."""
    import torch
    import transformers

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(vocab_size)
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    common = dict(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                  num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                  max_position_embeddings=max_position_embeddings, tie_word_embeddings=tie_word_embeddings,
                  bos_token_id=ids["<s>"], eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<unk>"],
                  initializer_range=initializer_range, rope_scaling=rope_scaling)
    classes = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
               "qwen2": ("Qwen2Config", "Qwen2ForCausalLM")}
    if architecture not in classes:
        raise ValueError(f"architecture must be one of {sorted(classes)}, got {architecture!r}")
    config_cls, model_cls = (getattr(transformers, n) for n in classes[architecture])
    if architecture == "mistral":
        common["sliding_window"] = None
    if linear_biases:
        if architecture != "llama":
            raise ValueError("linear_biases is a Llama option")
        common.update(attention_bias=True, mlp_bias=True)
    config = config_cls(**common)
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, dtype)).eval()
    with torch.no_grad():          # transformers starts biases (Qwen2's q/k/v) at zero: make them count
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, initializer_range)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(directory, safe_serialization=True, **kwargs)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "<|im_end|>",
        "unk_token": "<unk>", "pad_token": "<unk>", "add_bos_token": False,
        "model_max_length": max_position_embeddings, "chat_template": CHAT_TEMPLATE}, indent=2))
    # Served by unprivileged containers too (the serving image runs as uid 10001), and transformers
    # writes the weights 0600: every file readable by all.
    for f in directory.iterdir():
        if f.is_file():
            f.chmod(f.stat().st_mode | 0o444)
    return directory
