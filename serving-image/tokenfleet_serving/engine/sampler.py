"""Turn a batch of logits into next tokens, one row per request.

Order of operations per row: penalties -> (greedy: argmax) | temperature ->
top-k -> top-p -> min-p -> draw with the request's own generator (seeded
requests are reproducible regardless of batch composition). Logprobs are
reported from the raw model distribution (before penalties and temperature).
"""
from __future__ import annotations

import torch

from .request import Request, TokenLogprob


def apply_penalties(row: torch.Tensor, req: Request) -> None:
    p = req.params
    if p.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
        vals = row[ids]
        row[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        counts = torch.bincount(torch.tensor(req.output_token_ids), minlength=row.numel())[: row.numel()]
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def filter_probs(logits: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """Probabilities of one row after top-k, top-p and min-p truncation (renormalized)."""
    if top_k > 0 and top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs   # mass strictly above each token
        drop = before >= top_p
        drop[0] = False
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample(logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
    simple = all(r.params.greedy and not r.params.needs_penalties and r.params.logprobs is None for r in requests)
    if simple:                    # the common greedy batch: argmax where the logits are
        return logits.argmax(dim=-1).tolist(), [None] * len(requests)
    raw = logits.float().cpu()    # per-request generators live on the CPU
    work = raw
    if any(r.params.needs_penalties for r in requests):
        work = raw.clone()
        for i, r in enumerate(requests):
            if r.params.needs_penalties:
                apply_penalties(work[i], r)
    tokens = work.argmax(dim=-1).tolist()
    for i, r in enumerate(requests):
        p = r.params
        if p.greedy:
            continue
        probs = filter_probs(work[i] / p.temperature, p.top_k, p.top_p, p.min_p)
        tokens[i] = int(torch.multinomial(probs, 1, generator=r.generator).item())
    logprobs: list[TokenLogprob | None] = [None] * len(requests)
    for i, r in enumerate(requests):
        if r.params.logprobs is not None:
            lp = torch.log_softmax(raw[i], dim=-1)
            top = torch.topk(lp, r.params.logprobs) if r.params.logprobs else None
            logprobs[i] = TokenLogprob(
                token_id=tokens[i], logprob=float(lp[tokens[i]]),
                top=list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [])
    return tokens, logprobs
