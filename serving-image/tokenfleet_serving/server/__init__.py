"""The OpenAI-compatible HTTP server over the engine (``tokenfleet serve``)."""
