"""A compact continuous-batching LLM engine with a paged KV cache and prefix caching.

Names are imported lazily: the torch-free parts (``block_pool``,
``tokenizer``, ``sampling_params``, ``config``) can be imported by the router
and the server's request parsing without pulling in torch.
"""
from importlib import import_module

_EXPORTS = {
    "ROOT_HASH": "block_pool", "hash_block": "block_pool", "hash_prefix_blocks": "block_pool",
    "ConfigError": "config", "ModelConfig": "config", "parse_model_config": "config",
    "CheckpointError": "config",
    "EngineConfig": "engine", "EngineStats": "engine", "LLMEngine": "engine", "choose_dtype": "dtype_choice",
    "load_checkpoint": "loader", "load_tokenizer": "tokenizer",
    "RequestOutput": "request", "TokenLogprob": "request",
    "SamplingParams": "sampling_params",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    globals()[name] = value
    return value
