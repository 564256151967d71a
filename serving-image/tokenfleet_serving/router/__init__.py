"""The cache- and load-aware router (``tokenfleet route``).

An OpenAI-compatible reverse proxy in front of the serving replicas of one
InferenceService. It hashes each prompt into the engine's prefix-block hashes,
polls every replica's load, KV usage and cached blocks, and sends the request
to the replica chosen by ``policy.choose``. Torch-free: it runs in the serving
image but never imports the engine.

Modules, data flowing one way:
``config`` (router.json, endpoints.json) -> ``prompt`` (tokens of a request) ->
``prefix`` (block hashes) -> ``state`` (polled backend state) -> ``policy``
(the choice, pure) -> ``app`` (the proxy) -> ``main`` (command line).
"""
