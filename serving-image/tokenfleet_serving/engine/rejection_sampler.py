"""Verification of draft tokens against the target model, exact in distribution (Leviathan et al., 2023).

The target scored a request's last token and its k drafts in one forward pass: row i of ``target_logits``
[k + 1, vocab] is the target's next-token distribution after the i-th draft (row 0: after the last real
token). Verification emits the accepted drafts plus one token of the target's own:

* greedy: draft i is accepted while it is the target's argmax of row i; the first mismatch emits the
  argmax instead, and with every draft accepted row k's argmax is a bonus token. So the output is exactly
  what greedy decoding gives, token for token;
* sampled: with p_i the target's distribution of row i (after temperature, top-k, top-p, min-p, as the
  sampler applies them) and q_i the distribution the draft was drawn from, draft x is accepted with
  probability min(1, p_i(x) / q_i(x)); on rejection the token is drawn from max(0, p_i - q_i), normalized;
  after k acceptances a bonus token is drawn from p_k. Each emitted token is then distributed as p. A prompt
  lookup draft is deterministic (q_i is all on x): acceptance has probability p_i(x), and the replacement is
  drawn from p_i without x.

Random numbers come from the request's own generator (its seed), as in the sampler.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import Request, TokenLogprob
from .sampler import filter_probs


@dataclass
class Verified:
    tokens: list[int]                    # accepted drafts, then the target's own token
    num_accepted: int                    # drafts accepted (len(tokens) - 1)
    logprobs: list[TokenLogprob] | None  # per emitted token, when the request asks for them


def target_probs(logits: torch.Tensor, req: Request) -> torch.Tensor:
    """p for every row of ``logits`` [rows, vocab] as the sampler would draw from it."""
    p = req.params
    return torch.stack([filter_probs(row / p.temperature, p.top_k, p.top_p, p.min_p) for row in logits])


def _draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator).item())


def verify(target_logits: torch.Tensor, drafts: list[int], req: Request,
           draft_probs: torch.Tensor | None = None) -> Verified:
    """Accept a prefix of ``drafts`` and add one target token. ``draft_probs`` [k, vocab]: the distributions
    the drafts were drawn from (None: deterministic drafts, as prompt lookup's)."""
    k = len(drafts)
    logits = target_logits.float()
    if req.params.greedy:
        best = logits.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < k and drafts[accepted] == best[accepted]:
            accepted += 1
        tokens = drafts[:accepted] + [best[accepted]]
    else:
        probs = target_probs(logits, req)
        gen = req.generator
        tokens = []
        for i, x in enumerate(drafts):
            p = probs[i]
            q_x = 1.0 if draft_probs is None else float(draft_probs[i, x])
            p_x = float(p[x])
            if q_x > 0 and float(torch.rand((), generator=gen)) * q_x < p_x:      # u < p(x) / q(x)
                tokens.append(x)
                continue
            if draft_probs is None:
                residual = p.clone()
                residual[x] = 0.0
            else:
                residual = (p - draft_probs[i].to(p.dtype)).clamp_(min=0.0)
            total = float(residual.sum())
            tokens.append(_draw(residual / total if total > 0 else p, gen))
            break
        else:
            tokens.append(_draw(probs[k], gen))
        accepted = len(tokens) - 1
    logprobs = None
    if req.params.logprobs is not None:
        lp = torch.log_softmax(logits[:len(tokens)], dim=-1)       # from the raw distribution, as the sampler
        n = req.params.logprobs
        logprobs = []
        for i, t in enumerate(tokens):
            top = torch.topk(lp[i], n) if n else None
            logprobs.append(TokenLogprob(token_id=t, logprob=float(lp[i, t]),
                                         top=list(zip(top.indices.tolist(), top.values.tolist())) if top else []))
    return Verified(tokens, accepted, logprobs)
