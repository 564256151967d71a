"""Turn chat messages and prompts into token ids with the checkpoint's tokenizer."""
from __future__ import annotations

from tokenfleet_serving.engine.chat_template import ChatTemplateError
from tokenfleet_serving.engine.tokenizer import Tokenizer

from .errors import ApiError
from .protocol import GenerationRequest


def render_chat(tokenizer: Tokenizer | None, req: GenerationRequest) -> list[int]:
    """Render with the chat template from tokenizer_config.json (in Hugging Face's Jinja environment, with the
    request's tools, documents and template variables), then tokenize.

    The template writes the special tokens itself (BOS included when the model
    wants one), so the rendered text is encoded without adding any.
    """
    if tokenizer is None or not tokenizer.chat_template:
        raise ApiError(400, "this model has no chat template (tokenizer_config.json 'chat_template'); "
                            "use /v1/completions", "messages")
    tools = list(req.tools.tools) if req.tools is not None else None
    try:
        text = tokenizer.apply_chat_template(req.messages or [], add_generation_prompt=req.add_generation_prompt,
                                             tools=tools, documents=req.documents, **req.chat_template_kwargs)
    except ChatTemplateError as e:
        raise ApiError(400, f"chat template rejected the messages: {e}", "messages") from e
    return _encode(tokenizer, text, "messages", add_special_tokens=False)


def _encode(tokenizer: Tokenizer, text: str, param: str, **kwargs) -> list[int]:
    """Tokenize text from a request; text the tokenizer cannot take is the request's fault (400)."""
    try:
        return tokenizer.encode(text, **kwargs)
    except (TypeError, ValueError, UnicodeError) as e:
        raise ApiError(400, f"'{param}' cannot be tokenized: {e}", param) from e


def prompt_token_ids(tokenizer: Tokenizer | None, req: GenerationRequest, vocab_size: int) -> list[int]:
    if req.kind == "chat":
        ids = render_chat(tokenizer, req)
    elif req.prompt_token_ids is not None:
        ids = req.prompt_token_ids
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"'prompt' token id {bad} is outside the vocabulary [0, {vocab_size})", "prompt")
    else:
        if tokenizer is None:
            raise ApiError(400, "this model has no tokenizer; send 'prompt' as token ids", "prompt")
        ids = _encode(tokenizer, req.prompt_text or "", "prompt")
    if not ids:
        raise ApiError(400, "the prompt tokenizes to no tokens", "messages" if req.kind == "chat" else "prompt")
    return ids
