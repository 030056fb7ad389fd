"""The daemon (`vismmoe-edge serve`) in rooms of their own, in the spirit of llama.cpp's and vLLM's servers:

- `protocol`: limits, errors in OpenAI's shape, request parsing and field checks, response bodies
- `images`: `image_url` parts read safely (local paths only under --image-dir), checked from their headers
- `admission`: the fair queue (refused clients keep their place) and Retry-After from the expected wait
- `worker`: jobs and the one thread that owns the Engine (streams `Engine.stream`, decodes images in turn)
- `constraints`: logit_bias, penalties and JSON constraints (llguidance) as logits processors (imports torch)
- `metrics`: counters and the Prometheus text format
- `bodies`, `policy`, `http`, `servers`: body framing and budgets; Host/Origin/API-key checks; the request
  handler; the TCP / Unix-socket servers with a connection cap
- `daemon`: the Service, signals and the `serve()` main loop
- `sdnotify`: systemd readiness, status and watchdog; `systemd`: the unit installer (`install-service`)

Importing any of them but `constraints` imports no torch, transformers or PIL: `serve --help` stays fast.
"""
