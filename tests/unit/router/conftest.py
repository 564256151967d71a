from harness.router_fixtures import tiny_model  # noqa: F401  (the router's 1,024-token checkpoint)
