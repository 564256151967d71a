"""Checkpoint definitions and the transformers reference used by the engine tests."""
from __future__ import annotations

import torch

# name -> create_random_checkpoint kwargs. initializer_range 0.2 spreads the logits so greedy
# argmax is decided by clear margins rather than float rounding.
CHECKPOINTS = {
    "llama": dict(architecture="llama", initializer_range=0.2, seed=1),
    "llama3-tied": dict(architecture="llama", tie_word_embeddings=True, initializer_range=0.2, seed=2,
                        num_heads=4, num_kv_heads=1,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(architecture="qwen2", initializer_range=0.2, seed=3),
    "mistral": dict(architecture="mistral", initializer_range=0.2, seed=4, num_kv_heads=4),
    "llama-biases": dict(architecture="llama", linear_biases=True, initializer_range=0.2, seed=5),
}


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()
