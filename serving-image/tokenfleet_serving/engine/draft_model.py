"""A small draft model that proposes tokens for the target to verify (speculative method ``draft``).

The draft is a Llama-family checkpoint with the target's tokenizer. It keeps its own paged KV cache (a pool
of its own, ``block_size`` like the target's) and, per request, the tokens whose keys and values it holds.
Proposing k tokens for a batch of requests is k batched forwards: the first feeds each request the tokens
the draft has not seen yet (its whole prompt the first time, afterwards the one or two tokens the last
verification added) and draws the first draft; each further one feeds the previous draft. After
verification the draft's cache is valid up to the first position where what it was fed differs from the
request's tokens; the rest is overwritten when those positions are fed again.

Drafts are drawn as the request samples: greedy requests take the draft's argmax, sampled ones draw from
the draft's distribution after the request's temperature, top-k, top-p and min-p, which verification needs
(``draft_probs``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from .batch import SeqChunk, build_batch
from .block_pool import BlockPool
from .config import CheckpointError
from .loader import load_checkpoint, load_config
from .model_runner import ModelRunner
from .request import Request
from .sampler import filter_probs
from .tokenizer import load_tokenizer


def check_compatible(target_dir: str | Path, draft_dir: str | Path) -> None:
    """The draft must speak the target's tokens: the same vocabulary size, and where the target has a
    tokenizer.json, the same token for every id. Errors name the draft's file."""
    target_dir, draft_dir = Path(target_dir), Path(draft_dir)
    target, draft = load_config(target_dir), load_config(draft_dir)
    if draft.vocab_size != target.vocab_size:
        raise CheckpointError(f"{draft_dir / 'config.json'}: field 'vocab_size' = {draft.vocab_size}, but the "
                              f"target model's is {target.vocab_size}; the draft model must use the target's "
                              "tokenizer")
    if not (target_dir / "tokenizer.json").is_file():
        return
    if not (draft_dir / "tokenizer.json").is_file():
        raise CheckpointError(f"{draft_dir / 'tokenizer.json'}: file not found; the draft model must ship the "
                              "target's tokenizer")
    target_vocab = load_tokenizer(target_dir).backend.get_vocab(with_added_tokens=True)
    draft_vocab = load_tokenizer(draft_dir).backend.get_vocab(with_added_tokens=True)
    if draft_vocab != target_vocab:
        differing = len(set(draft_vocab.items()) ^ set(target_vocab.items())) // 2 or 1
        raise CheckpointError(f"{draft_dir / 'tokenizer.json'}: the draft's vocabulary differs from the target's "
                              f"(about {differing} of {len(target_vocab)} tokens map to other ids); the draft "
                              "model must use the target's tokenizer")


@dataclass
class _State:
    blocks: list[int] = field(default_factory=list)
    fed: list[int] = field(default_factory=list)        # tokens whose keys and values the draft cache holds


class DraftModel:
    def __init__(self, directory: str | Path, target_dir: str | Path, dtype: torch.dtype, device: torch.device,
                 num_blocks: int, block_size: int, max_model_len: int, use_kernels: bool = True,
                 quantization: str = "none"):
        """The draft computes in the target's dtype and takes its quantization (int8 shrinks it too)."""
        check_compatible(target_dir, directory)
        load_dtype = torch.float32 if quantization == "int8" else dtype
        ckpt = load_checkpoint(directory, dtype=load_dtype, with_tokenizer=False)
        self.config = ckpt.config
        self.max_model_len = min(max_model_len, ckpt.config.max_model_len)
        self.runner = ModelRunner(ckpt.config, ckpt.weights, dtype, device, self.max_model_len,
                                use_kernels=use_kernels, quantization=quantization)
        del ckpt
        self.kv_cache_bytes = self.runner.allocate_kv_cache(num_blocks, block_size)
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.states: dict[str, _State] = {}

    def forget(self, request_id: str) -> None:
        state = self.states.pop(request_id, None)
        if state is not None and state.blocks:
            self.pool.release(state.blocks)

    def keep_only(self, request_ids: set[str]) -> None:
        """Free the cache of every request not in ``request_ids`` (finished, aborted, preempted)."""
        for rid in [r for r in self.states if r not in request_ids]:
            self.forget(rid)

    def _prepare(self, req: Request, k: int) -> SeqChunk | None:
        """The first chunk to feed for ``req`` (None when its drafts would not fit the pool or the context)."""
        tokens = req.all_token_ids
        last = len(tokens) - 1 + k - 1                         # the position of the last token fed this round
        if last >= self.max_model_len:
            return None
        state = self.states.setdefault(req.request_id, _State())
        valid = min(len(state.fed), len(tokens) - 1)
        for i in range(max(0, valid - 2 * k - 2), valid):    # only the tail can differ (the last drafts)
            if state.fed[i] != tokens[i]:
                valid = i
                break
        need = last // self.block_size + 1 - len(state.blocks)
        if need > self.pool.num_free:
            return None
        if need > 0:
            state.blocks += self.pool.allocate(need)
        state.fed = tokens[:valid]
        return SeqChunk(tokens[valid:], valid, state.blocks, True)

    def _draw(self, logits: torch.Tensor, reqs: list[Request]) -> tuple[list[int], list[torch.Tensor | None]]:
        tokens = logits.argmax(dim=-1).tolist()
        probs: list[torch.Tensor | None] = [None] * len(reqs)
        for i, r in enumerate(reqs):
            p = r.params
            if not p.greedy:
                q = probs[i] = filter_probs(logits[i].float() / p.temperature, p.top_k, p.top_p, p.min_p)
                tokens[i] = int(torch.multinomial(q, 1, generator=r.generator).item())
        return tokens, probs

    @torch.inference_mode()
    def propose(self, reqs: list[Request], ks: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """Per request up to ks[i] draft tokens and, for sampled requests, the [drafts, vocab] distributions
        they were drawn from (None for greedy requests; an empty proposal where the pool or context is short)."""
        out: list[tuple[list[int], torch.Tensor | None]] = [([], None)] * len(reqs)
        live = []
        chunks = []
        for i, (r, k) in enumerate(zip(reqs, ks)):
            chunk = self._prepare(r, k) if k > 0 else None
            if chunk is not None:
                live.append(i)
                chunks.append(chunk)
        drafts: dict[int, list[int]] = {i: [] for i in live}
        dists: dict[int, list[torch.Tensor]] = {i: [] for i in live}
        step = 0
        while chunks:
            logits = self.runner.forward(build_batch(chunks, self.block_size, self.runner.device,
                                                    self.runner.compiled_prefill))
            tokens, probs = self._draw(logits, [reqs[i] for i in live])
            next_live, chunks = [], []
            for i, t, p in zip(live, tokens, probs):
                state = self.states[reqs[i].request_id]
                drafts[i].append(t)
                if p is not None:
                    dists[i].append(p)
                if len(drafts[i]) < ks[i]:
                    position = len(reqs[i].all_token_ids) - 1 + step + 1
                    next_live.append(i)
                    chunks.append(SeqChunk([t], position, state.blocks, True))
            for i in live:                                      # what the draft cache now holds
                state = self.states[reqs[i].request_id]
                state.fed = reqs[i].all_token_ids + drafts[i][:-1]
            live = next_live
            step += 1
        for i in drafts:
            out[i] = (drafts[i], torch.stack(dists[i]) if dists[i] else None)
        return out
