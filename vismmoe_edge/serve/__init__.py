"""The daemon (`vismmoe-edge serve`) in rooms of their own, in the spirit of llama.cpp's and vLLM's servers:

- `protocol`: limits, errors in OpenAI's shape, request parsing, response bodies (no model, no sockets)
- `images`: `image_url` parts (data URLs, local files) read and decoded within the limits
- `worker`: jobs, the bounded queue and the one thread that owns the Engine (streams `Engine.stream`)
- `metrics`: counters and the Prometheus text format
- `http`: the request handler and the TCP / Unix-socket servers
- `daemon`: the Service, signals and the `serve()` main loop
- `sdnotify`: systemd readiness, status and watchdog; `systemd`: the unit installer (`install-service`)

Importing any of them imports no torch, transformers or PIL: `serve --help` stays fast.
"""
