"""Pure builders: from a spec to the child manifests the operator applies.

Nothing here talks to the API server, so every child can be unit-tested.
"""
