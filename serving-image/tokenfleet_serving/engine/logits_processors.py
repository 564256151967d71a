"""What the sampler does to the logits before choosing, for the whole batch at once: ``logit_bias`` added,
EOS and stop tokens forbidden before ``min_tokens``, and the grammar's mask for constrained requests
(structured/). Free and constrained requests share the step: rows that need nothing are left as they are.
"""
from __future__ import annotations

import numpy as np
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
    """The processed logits (float32, a copy on the CPU), or None when no row needs processing. Raises
    :class:`NoTokenLeft` for a row with no token left to choose.

    The work is done with numpy, single-threaded: on a busy CPU host each torch operation over the whole batch
    (above torch's grain size) waits for its second OpenMP thread to be scheduled, milliseconds every time, which
    made these few operations cost more than the forward pass at batch 16."""
    rows = [i for i, r in enumerate(requests) if processes(r)]
    if not rows:
        return None
    out = logits.detach().float().cpu().numpy().copy()
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
        np.add.at(out, (np.array(bias_rows), np.array(bias_cols)), np.array(bias_vals, dtype=np.float32))
    if ban_rows:
        out[np.array(ban_rows), np.array(ban_cols)] = -np.inf
    if constrained:
        from .structured.mask import allowed_tokens, fill_bitmask

        bitmask = fill_bitmask([requests[i].grammar for i in constrained], out.shape[1])      # type: ignore[misc]
        allowed = allowed_tokens(bitmask, out.shape[1])
        out[constrained] = np.where(allowed, out[constrained], np.float32(-np.inf))
    best = out[rows].max(axis=1)
    for i, m in zip(rows, best.tolist()):
        if m == float("-inf"):
            r = requests[i]
            why = (f"the grammar allows no token ({r.grammar.get_error() or 'no continuation'})"
                   if r.grammar is not None else "logit_bias and min_tokens leave no token to choose")
            raise NoTokenLeft(r.request_id, why)
    return torch.from_numpy(out)
