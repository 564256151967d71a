"""A compact continuous-batching LLM engine with a paged KV cache and prefix caching."""
from .block_pool import ROOT_HASH, hash_block, hash_prefix_blocks
from .config import ConfigError, ModelConfig, parse_model_config
from .engine import EngineConfig, EngineStats, LLMEngine, choose_dtype
from .loader import CheckpointError, load_checkpoint
from .request import RequestOutput, TokenLogprob
from .sampling_params import SamplingParams

__all__ = ["ROOT_HASH", "hash_block", "hash_prefix_blocks", "ConfigError", "ModelConfig", "parse_model_config",
           "EngineConfig", "EngineStats", "LLMEngine", "choose_dtype", "CheckpointError", "load_checkpoint",
           "RequestOutput", "TokenLogprob", "SamplingParams"]
