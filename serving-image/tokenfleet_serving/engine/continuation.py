"""Continuing a request that another replica started.

When a replica dies in the middle of a stream, the router sends the request again to another replica together
with what the client has already received: the output token ids and the output text. This replica then takes
those tokens as output it generated itself:

- they count towards ``max_tokens``, the penalties over output tokens, and ``usage.completion_tokens``;
- the detokenizer is primed with them, so the next text delta is exactly the one an uninterrupted run would
  have sent next (including text the first replica held back: the end of an incomplete UTF-8 sequence, or
  the start of what might have become a stop string), and a stop string that spans the cut is found;
- a seeded request's generator is advanced by one draw per delivered token, as sampling them here would have
  advanced it, so the following tokens are those the uninterrupted run would have drawn.

The KV cache of prompt + delivered tokens is recomputed (or found in this replica's prefix cache). Greedy and
seeded requests therefore continue with the same tokens, up to the floating-point difference between
computing those positions in one prefill and one decode step at a time (none in float32 on CPU in practice:
the tests hold it to exact equality there).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:       # torch-free at import: the server's request parsing (and the router) build Continuations
    import torch

    from .request import Request


@dataclass(frozen=True)
class Continuation:
    """What the client has received of a request so far."""

    output_token_ids: tuple[int, ...]
    delivered_text: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "output_token_ids", tuple(self.output_token_ids))


def check(cont: Continuation, num_prompt_tokens: int, max_tokens: int, vocab_size: int, max_model_len: int) -> None:
    """ValueError naming the problem when ``cont`` cannot continue a request with these limits."""
    ids = cont.output_token_ids
    if not ids:
        return
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in ids):
        raise ValueError(f"continuation output_token_ids must be integers in [0, {vocab_size})")
    if len(ids) >= max_tokens:
        raise ValueError(f"continuation has {len(ids)} output tokens; max_tokens is {max_tokens}, so the request "
                         "was complete")
    if num_prompt_tokens + len(ids) >= max_model_len:
        raise ValueError(f"prompt ({num_prompt_tokens}) + continued output ({len(ids)}) tokens leave no room in "
                         f"the context of {max_model_len}")


def advance_generator(generator: torch.Generator, draws: int, vocab_size: int) -> None:
    """Move ``generator`` as ``draws`` sampled tokens moved it: the sampler draws one token per step with
    ``torch.multinomial`` over a float32 row of the vocabulary, which consumes the same random numbers whatever
    the probabilities are."""
    import torch

    if draws <= 0:
        return
    ones = torch.ones(vocab_size, dtype=torch.float32)
    for _ in range(draws):
        torch.multinomial(ones, 1, generator=generator)


def apply(req: Request, cont: Continuation, vocab_size: int) -> None:
    """Make ``req`` (new, not yet scheduled, detokenizer attached when the engine has a tokenizer) look as if
    it had generated ``cont.output_token_ids`` itself, with ``cont.delivered_text`` already reported."""
    ids: Sequence[int] = cont.output_token_ids
    if not ids:
        if cont.delivered_text:
            raise ValueError("continuation has delivered text but no output token ids")
        return
    req.all_token_ids.extend(ids)
    req.output_token_ids.extend(ids)
    if req.detokenizer is not None:
        req.output_text = req.detokenizer.push(list(ids))
        if not req.output_text.startswith(cont.delivered_text):
            raise ValueError("continuation delivered_text is not the text this replica decodes "
                             "output_token_ids to (another model or tokenizer?)")
    elif cont.delivered_text:
        raise ValueError("continuation delivered_text needs a tokenizer on this replica")
    req.reported_text_len = len(cont.delivered_text)
    if req.generator is not None and not req.params.greedy:
        advance_generator(req.generator, len(ids), vocab_size)
