"""A request's state as it moves through the engine, and what the engine reports back."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .block_pool import adapter_root_hash, hash_prefix_blocks
from .sampling_params import SamplingParams

if TYPE_CHECKING:
    from llguidance import LLMatcher

    from .lora_adapter import LoRAAdapter
    from .tokenizer import IncrementalDetokenizer


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]       # (token id, logprob), best first


@dataclass
class RequestOutput:
    """Incremental result of one request after one engine step."""
    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None          # "stop", "length", "abort", "error" or None while running
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int             # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprob] | None = None
    stop_reason: int | str | None = None   # the stop token id or stop string that matched
    error: str | None = None           # finish_reason "error": what failed (this request alone)
    error_param: str | None = None     # the request field at fault, when the request was (its grammar): a 400


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), arrival_time: float | None = None, lora: str | None = None):
        self.request_id = request_id
        self.lora = lora                   # the LoRA adapter's name (None: the base model)
        self.root_hash = adapter_root_hash(lora)     # its first block's hash chains from this
        self.adapter: LoRAAdapter | None = None      # the adapter's version it was admitted with (its root_hash's)
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = () if params.ignore_eos else tuple(eos_token_ids)
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.all_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1        # set when first scheduled
        self.block_hashes: list[bytes] = []
        self.lower_tier_blocks: dict[str, int] = {}   # blocks copied back for it from the host / disk tier
        self.status = RequestStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None      # set when the engine failed this request alone
        self.error_param: str | None = None   # ... because of this field of its own (its structured output)
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)
        # pending output since the last report
        self.pending_token_ids: list[int] = []
        self.pending_logprobs: list[TokenLogprob] = []
        self.detokenizer: IncrementalDetokenizer | None = None
        self.spec_token_ids: list[int] = []      # draft tokens to verify in the next step (speculative.py)
        self.output_text = ""
        self.reported_text_len = 0
        self.grammar: LLMatcher | None = None    # the structured output's matcher (structured/), at the output's end
        self.prompt_parent: Request | None = None   # n > 1: the sibling computing the shared prompt's KV first

    @property
    def waits_for_prompt(self) -> bool:
        """A sibling is still computing this request's prompt: admitted after it, the prompt's full blocks come
        from the prefix cache instead of being computed again."""
        parent = self.prompt_parent
        return parent is not None and not parent.is_finished and parent.num_computed_tokens < parent.num_prompt_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def update_block_hashes(self, block_size: int) -> None:
        parent = self.block_hashes[-1] if self.block_hashes else self.root_hash
        self.block_hashes += hash_prefix_blocks(self.all_token_ids, block_size, len(self.block_hashes), parent)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        self.pending_token_ids.append(token_id)
