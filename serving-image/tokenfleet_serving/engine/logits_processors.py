"""What the sampler does to the logits before choosing, for the whole batch at once: ``logit_bias`` added,
EOS and stop tokens forbidden before ``min_tokens``, and the grammar's mask for constrained requests
(structured/). Free and constrained requests share the step: rows that need nothing are left as they are.
"""
from __future__ import annotations

import torch

from .request import Request


class NoTokenLeft(ValueError):
    def __init__(self, request_id: str, why: str):
        super().__init__(why)
        self.request_id = request_id


def processes(req: Request) -> bool:
    """Whether this step's logits of ``req`` are changed before sampling."""
    p = req.params
    return bool(p.logit_bias) or req.grammar is not None or _holds_stop(req)


def _holds_stop(req: Request) -> bool:
    """min_tokens not reached: EOS and stop tokens are forbidden (unless the grammar allows nothing else)."""
    if len(req.output_token_ids) >= req.params.min_tokens:
        return False
    return req.grammar is None or not req.grammar.is_stopped()


def stop_token_ids(req: Request) -> tuple[int, ...]:
    return tuple(req.eos_token_ids) + tuple(req.params.stop_token_ids)


def apply(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor | None:
    """The processed logits (float32, a copy), or None when no row needs processing. Raises
    :class:`NoTokenLeft` for a row with no token left to choose."""
    rows = [i for i, r in enumerate(requests) if processes(r)]
    if not rows:
        return None
    out = logits.float().clone()
    bias_rows: list[int] = []
    bias_cols: list[int] = []
    bias_vals: list[float] = []
    ban_rows: list[int] = []
    ban_cols: list[int] = []
    constrained: list[int] = []
    for i in rows:
        r = requests[i]
        for token, value in r.params.logit_bias:
            bias_rows.append(i)
            bias_cols.append(token)
            bias_vals.append(value)
        if _holds_stop(r):
            ids = stop_token_ids(r)
            ban_rows += [i] * len(ids)
            ban_cols += ids
        if r.grammar is not None:
            constrained.append(i)
    if bias_rows:
        out.index_put_((torch.tensor(bias_rows, device=out.device), torch.tensor(bias_cols, device=out.device)),
                       torch.tensor(bias_vals, dtype=out.dtype, device=out.device), accumulate=True)
    if ban_rows:
        out[torch.tensor(ban_rows, device=out.device), torch.tensor(ban_cols, device=out.device)] = float("-inf")
    if constrained:
        from .structured.mask import apply_bitmask, fill_bitmask

        matchers = [requests[i].grammar for i in constrained]
        apply_bitmask(out, constrained, fill_bitmask(matchers, out.shape[1]))       # type: ignore[arg-type]
    best = out[rows].amax(dim=-1).tolist()
    for i, m in zip(rows, best):
        if m == float("-inf"):
            r = requests[i]
            why = (f"the grammar allows no token ({r.grammar.get_error() or 'no continuation'})"
                   if r.grammar is not None else "logit_bias and min_tokens leave no token to choose")
            raise NoTokenLeft(r.request_id, why)
    return out
