"""Turn a batch of logits into next tokens, one row per request.

Order of operations per row: logit_bias, min_tokens and the grammar's mask (``logits_processors.py``, the
whole batch at once) -> penalties -> (greedy: argmax) | temperature ->
top-k -> top-p -> min-p -> draw with the request's own generator (seeded
requests are reproducible regardless of batch composition). Logprobs are
reported from the raw model distribution (before penalties and temperature).

Every row's model logits are checked for NaN and infinity, the greedy fast path's too (one reduction
over the batch): a model or LoRA adapter that produces them fails the request with an error instead of
returning an arbitrary token.

Numerics: every row that is penalized or sampled is penalized and scaled in
float64, and temperature scales the logits' distances from their maximum,
``(logits - max) / T``, which is <= 0 everywhere and exactly 0 at the maximum.
So any temperature above 0, down to the smallest double, gives a proper
distribution (at tiny temperatures, all mass on the maximum or split among
tied maxima: the limit the formula has), and the bounds in
``sampling_params.py`` keep the penalties' factors finite. A row that still
cannot be sampled (the model produced a non-finite logit) raises
:class:`SamplingError` naming its request, so the engine fails that request
alone.
"""
from __future__ import annotations

import torch

from . import logits_processors
from .request import Request, TokenLogprob


class SamplingError(RuntimeError):
    """One request's row could not be sampled; the message names the request."""

    def __init__(self, request_id: str, why: str):
        super().__init__(f"request {request_id}: {why}")
        self.request_id = request_id


def apply_penalties(row: torch.Tensor, req: Request) -> None:
    p = req.params
    if p.repetition_penalty != 1.0:
        ids = torch.tensor(sorted(set(req.all_token_ids)), dtype=torch.long)
        vals = row[ids]
        row[ids] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and req.output_token_ids:
        counts = torch.bincount(torch.tensor(req.output_token_ids), minlength=row.numel())[: row.numel()]
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)


def scale(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Logits divided by the temperature, shifted so that the maximum is 0 (finite for any T > 0)."""
    return (logits - logits.max()) / temperature


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


def _check_sampleable(row: torch.Tensor, req: Request, what: str) -> None:
    """No NaN or +inf, and some token finite (masked tokens are -inf)."""
    if bool(torch.isnan(row).any()) or bool(torch.isposinf(row).any()) or not bool(torch.isfinite(row).any()):
        raise SamplingError(req.request_id, f"{what} contain NaN or infinity, or no finite value")


def _check_finite(row: torch.Tensor, req: Request, what: str) -> None:
    if not bool(torch.isfinite(row).all()):
        raise SamplingError(req.request_id, f"{what} contain NaN or infinity")


def _check_batch_finite(logits: torch.Tensor, requests: list[Request]) -> None:
    """The greedy fast path's check (one reduction over the batch): an argmax over NaN or infinity would
    pick a meaningless token, so the first row that has one fails its request."""
    if bool(torch.isfinite(logits.sum(dim=-1, dtype=torch.float32)).all()):
        return                    # any NaN or infinity makes its row's sum one (the common case ends here)
    finite = torch.isfinite(logits).all(dim=-1)
    if not bool(finite.all()):
        row = int((~finite).nonzero()[0, 0])
        raise SamplingError(requests[row].request_id, "the model's logits contain NaN or infinity")


def sample(logits: torch.Tensor, requests: list[Request]) -> tuple[list[int], list[TokenLogprob | None]]:
    """Next token (and logprobs when asked) per row. Every row's distribution is computed and checked
    before any row draws, so a SamplingError leaves every request's generator untouched. ``logit_bias``,
    ``min_tokens`` and the grammar's mask (logits_processors.py) change the logits the token is chosen from,
    for the whole batch at once; logprobs stay those of the model."""
    try:
        processed = logits_processors.apply(logits, requests)
    except logits_processors.NoTokenLeft as e:
        raise SamplingError(e.request_id, str(e)) from None
    simple = all(r.params.greedy and not r.params.needs_penalties and r.params.logprobs is None for r in requests)
    if simple:                    # the common greedy batch: argmax where the logits are
        _check_batch_finite(logits, requests)
        if processed is None:
            return logits.argmax(dim=-1).tolist(), [None] * len(requests)
        return processed.numpy().argmax(axis=1).tolist(), [None] * len(requests)
    raw = logits.float().cpu()    # per-request generators live on the CPU
    chosen_from = raw if processed is None else processed.cpu()
    tokens = chosen_from.argmax(dim=-1).tolist()
    draws: list[tuple[int, torch.Tensor]] = []
    for i, r in enumerate(requests):
        p = r.params
        _check_finite(raw[i], r, "the model's logits")
        if not p.needs_penalties and p.greedy:
            continue
        work = chosen_from[i].double()
        if p.needs_penalties:
            apply_penalties(work, r)
            _check_sampleable(work, r, "the penalized logits")
        if p.greedy:
            tokens[i] = int(work.argmax())
            continue
        # scaled in float64 (T may be 5e-324), filtered in float32: every value is <= 0 with a 0 at the
        # maximum, so the cast can only round far-off tokens down to -inf, and the sort costs what it did
        probs = filter_probs(scale(work, p.temperature).float(), p.top_k, p.top_p, p.min_p)
        _check_finite(probs, r, "the sampling probabilities")
        draws.append((i, probs))
    for i, probs in draws:
        tokens[i] = int(torch.multinomial(probs, 1, generator=requests[i].generator).item())
    logprobs: list[TokenLogprob | None] = [None] * len(requests)
    for i, r in enumerate(requests):
        if r.params.logprobs is not None:
            lp = torch.log_softmax(raw[i], dim=-1)
            k = min(r.params.logprobs, lp.numel())
            top = torch.topk(lp, k) if k else None
            logprobs[i] = TokenLogprob(
                token_id=tokens[i], logprob=float(lp[tokens[i]]),
                top=list(zip(top.indices.tolist(), top.values.tolist())) if top is not None else [])
    return tokens, logprobs
