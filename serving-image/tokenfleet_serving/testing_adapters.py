"""Random-weight LoRA adapters written by ``peft`` for a checkpoint of ``testing_models.py``.

``peft`` starts lora_B at zero (an adapter that changes nothing); here both A and B are drawn at random so
the adapter changes the output, and ``save_pretrained`` writes PEFT's own layout (adapter_config.json,
adapter_model.safetensors). Needs ``peft`` and ``transformers`` (dev dependencies).
"""
from __future__ import annotations

from pathlib import Path


def create_random_adapter(base_dir: str | Path, directory: str | Path, *, r: int = 8, lora_alpha: float = 16,
                          target_modules: list[str] | str = ("q_proj", "v_proj"), seed: int = 0,
                          scale: float = 0.1, use_rslora: bool = False, base_model=None) -> Path:
    """Write a LoRA adapter for the checkpoint in ``base_dir`` to ``directory``; ``scale``: standard
    deviation of the A and B entries. ``base_model``: that checkpoint already loaded (saves reading it)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    directory = Path(directory)
    base = base_model if base_model is not None else AutoModelForCausalLM.from_pretrained(base_dir,
                                                                                          dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules) if not isinstance(
        target_modules, str) else target_modules, lora_dropout=0.0, bias="none", use_rslora=use_rslora,
        task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    model.save_pretrained(directory)
    model.unload()        # the base model as it was (a given ``base_model`` can be reused)
    return directory
