"""The OpenAI wire format, shared by the server and the router (as vLLM keeps ``entrypoints/openai``).

- ``protocol.py``: requests parsed and validated into :class:`GenerationRequest`; response bodies and chunks;
- ``errors.py``: OpenAI's error body and :class:`ApiError`, which names the field at fault;
- ``sse.py``: Server-Sent Events, written and read;
- ``prompt.py``: a request's prompt as token ids (the chat template, the tokenizer).

Nothing here imports torch, aiohttp or the engine's model code: the router uses it as it is.
"""
