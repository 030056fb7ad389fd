"""`vismmoe-edge serve` (the OpenAI-compatible daemon) and `install-service` (its systemd unit)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated

import typer

from vismmoe_edge.cli.common import fail, load_options
from vismmoe_edge.cli.options import (
    AffinityWeightOpt,
    BudgetOpt,
    CompressorOpt,
    DeviceOpt,
    DtypeOpt,
    HostTierOpt,
    KeepRatioOpt,
    PinnedOpt,
    PolicyOpt,
    PredictorOpt,
    PrefetchDepthOpt,
    PrefixCacheOpt,
    ProfileOpt,
    SalientRatioOpt,
    TierOpt,
)
from vismmoe_edge.compress.config import CompressionConfig
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.serve.systemd import DEFAULT_ENV_FILE, DEFAULT_LISTEN, DEFAULT_UNIT_DIR, UNIT_NAME, install_service
from vismmoe_edge.units import parse_size


def serve_command(
    model: Annotated[
        Path | None, typer.Option("--model", help="Hugging Face model directory; omit for the built-in demo model")
    ] = None,
    model_id: Annotated[
        str | None, typer.Option("--model-id", help="the model name clients send; default: the directory name")
    ] = None,
    host: Annotated[str, typer.Option("--host", help="TCP address; loopback by default")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="TCP port; 0 picks a free one")] = 8000,
    unix_socket: Annotated[
        Path | None, typer.Option("--unix-socket", help="listen on this Unix socket instead of TCP")
    ] = None,
    socket_mode: Annotated[
        str, typer.Option("--socket-mode", help="the Unix socket's permissions, in octal (0660: owner and group)")
    ] = "0660",
    listen: Annotated[
        str | None,
        typer.Option("--listen", help="unix:PATH or HOST:PORT; replaces --host, --port and --unix-socket"),
    ] = None,
    memory_budget: BudgetOpt = "auto",
    pinned_layers: PinnedOpt = None,
    device: DeviceOpt = "auto",
    dtype: DtypeOpt = "auto",
    tier: TierOpt = "auto",
    predictor: PredictorOpt = "auto",
    policy: PolicyOpt = "popularity",
    host_tier: HostTierOpt = "auto",
    prefetch_depth: PrefetchDepthOpt = None,
    compressor: CompressorOpt = "none",
    keep_ratio: KeepRatioOpt = 0.7,
    salient_ratio: SalientRatioOpt = 0.3,
    affinity_weight: AffinityWeightOpt = 2.0,
    prefix_cache_bytes: PrefixCacheOpt = "auto",
    profile: ProfileOpt = "auto",  # SIGHUP re-plans
    image_dir: Annotated[
        list[Path] | None,
        typer.Option(
            "--image-dir",
            help="serve local image paths (file:// or /abs) from under this directory; repeatable; default: none "
            "(local paths off, data URLs only)",
        ),
    ] = None,
    allowed_origin: Annotated[
        list[str] | None,
        typer.Option(
            "--allowed-origin",
            help="a browser origin (http://host:port) allowed to call the API; repeatable; default: none",
        ),
    ] = None,
    api_key: Annotated[
        str | None,
        typer.Option(
            "--api-key",
            envvar="VISMMOE_EDGE_API_KEY",
            show_envvar=True,
            help="require Authorization: Bearer KEY on /v1/ (prefer the environment variable: argv is public)",
        ),
    ] = None,
    max_queue: Annotated[int, typer.Option("--max-queue", min=1, help="requests waiting; more get 429")] = 8,
    max_prompt_tokens: Annotated[int, typer.Option("--max-prompt-tokens", min=1)] = 4096,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", "--max-new-tokens", min=1, help="cap on a reply's tokens, and the default")
    ] = 512,
    max_image_bytes: Annotated[str, typer.Option("--max-image-bytes", help="per image, e.g. 20MiB")] = "20MiB",
    max_image_pixels: Annotated[int, typer.Option("--max-image-pixels", min=1)] = 4096 * 4096,
    max_images: Annotated[int, typer.Option("--max-images", min=0, help="images (and clips) per request")] = 8,
    max_video_frames: Annotated[
        int, typer.Option("--max-video-frames", min=2, help="frames of one clip once sampled; more: refused (400)")
    ] = 32,
    max_video_bytes: Annotated[
        str, typer.Option("--max-video-bytes", help="per clip file as sent, e.g. 20MiB")
    ] = "20MiB",
    video_fps: Annotated[
        float, typer.Option("--video-fps", min=0.01, max=60.0, help="frames sampled a second, unless a part says")
    ] = 2.0,
    video_max_pixels: Annotated[
        int, typer.Option("--video-max-pixels", min=1, help="pixels of each frame once resized (32x32 per token pair)")
    ] = 128 * 32 * 32,
    max_body_bytes: Annotated[str, typer.Option("--max-body-bytes", help="request body size; more gets 413")] = "32MiB",
    max_decoded_bytes: Annotated[
        str,
        typer.Option(
            "--max-decoded-bytes", help="a request's images at their peak, decoded and processed (from their headers)"
        ),
    ] = "512MiB",
    max_pending_bytes: Annotated[
        str, typer.Option("--max-pending-bytes", help="request bodies held at once; more get 503")
    ] = "256MiB",
    max_connections: Annotated[
        int, typer.Option("--max-connections", min=1, help="open client connections; more get 503")
    ] = 64,
    max_connections_per_client: Annotated[
        int | None,
        typer.Option(
            "--max-connections-per-client",
            min=1,
            help="open connections of one IP address (or uid on a Unix socket); default: 7/8 of --max-connections",
        ),
    ] = None,
    header_timeout: Annotated[
        float, typer.Option("--header-timeout", min=0.1, help="seconds for a request's line and headers; then 408")
    ] = 10.0,
    body_timeout: Annotated[
        float, typer.Option("--body-timeout", min=0.1, help="seconds for a request's body after its headers; then 408")
    ] = 60.0,
    request_timeout: Annotated[
        float, typer.Option("--request-timeout", min=0.1, help="seconds from arrival, queueing included")
    ] = 300.0,
    drain_timeout: Annotated[
        float, typer.Option("--drain-timeout", min=0.0, help="on SIGTERM, seconds to finish in-flight work")
    ] = 30.0,
    load_timeout: Annotated[
        float, typer.Option("--load-timeout", min=1.0, help="start-up time asked of systemd (EXTEND_TIMEOUT_USEC)")
    ] = 600.0,
    log_level: Annotated[str, typer.Option("--log-level", help="debug, info, warning or error")] = "info",
) -> None:
    """Serve one loaded model over an OpenAI-compatible HTTP API (a systemd Type=notify daemon)."""
    # lazy: the daemon's modules (HTTP servers, workers, metrics) are a tenth of a second that every other command,
    # and each usage error of this one, would pay at start-up
    from vismmoe_edge.serve.daemon import ServeOptions, serve
    from vismmoe_edge.serve.policy import parse_origin
    from vismmoe_edge.serve.protocol import Limits
    from vismmoe_edge.serve.servers import parse_listen

    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO), format="%(asctime)s %(levelname)s %(message)s"
    )
    try:
        limits = Limits(
            max_body_bytes=parse_size(max_body_bytes, what="--max-body-bytes"),
            max_image_bytes=parse_size(max_image_bytes, what="--max-image-bytes"),
            max_decoded_bytes=parse_size(max_decoded_bytes, what="--max-decoded-bytes"),
            max_pending_bytes=parse_size(max_pending_bytes, what="--max-pending-bytes"),
            max_connections=max_connections,
            max_connections_per_client=max_connections_per_client or max_connections - max(1, max_connections // 8),
            header_timeout_s=header_timeout,
            body_timeout_s=body_timeout,
            max_image_pixels=max_image_pixels,
            max_images=max_images,
            max_video_frames=max_video_frames,
            max_video_bytes=parse_size(max_video_bytes, what="--max-video-bytes"),
            video_fps=video_fps,
            video_max_pixels=video_max_pixels,
            max_prompt_tokens=max_prompt_tokens,
            max_tokens=max_tokens,
            max_queue=max_queue,
            request_timeout_s=request_timeout,
        )
        compression = CompressionConfig(compressor, keep_ratio, salient_ratio, affinity_weight)  # torch-free
        load = load_options(locals(), compression=compression)
        if listen is not None:
            host, port, unix_socket = parse_listen(listen)
        mode = parse_socket_mode(socket_mode)
        options = ServeOptions(
            model=model,
            model_id=model_id,
            host=host,
            port=port,
            unix_socket=unix_socket,
            socket_mode=mode,
            load=load,
            image_dirs=tuple(image_dir or ()),
            allowed_origins=tuple(parse_origin(o) for o in allowed_origin or ()),
            api_key=api_key or None,
            limits=limits,
            drain_timeout_s=drain_timeout,
            load_timeout_s=load_timeout,
        )
        code = serve(options)
    except VismmoeError as e:
        raise fail(str(e)) from None
    raise typer.Exit(code)


def parse_socket_mode(text: str) -> int:
    if not (3 <= len(text) <= 4 and all(c in "01234567" for c in text)) or int(text, 8) > 0o777:
        raise VismmoeError(f"--socket-mode {text!r}: give permissions in octal, such as 0660 or 0600")
    return int(text, 8)


def install_service_command(
    model: Annotated[
        Path | None,
        typer.Option("--model", help="model directory the daemon serves; omit for the built-in (random) demo model"),
    ] = None,
    memory_budget: BudgetOpt = "auto",
    pinned_layers: PinnedOpt = None,
    tier: TierOpt = "auto",
    predictor: PredictorOpt = "auto",
    policy: PolicyOpt = "popularity",
    compressor: CompressorOpt = "none",
    keep_ratio: KeepRatioOpt = 0.7,
    profile: ProfileOpt = "auto",  # auto follows the board's power mode
    listen: Annotated[str, typer.Option("--listen", help="unix:PATH or HOST:PORT")] = DEFAULT_LISTEN,
    user: Annotated[str, typer.Option("--user", help="service user; it should own the model files")] = "vismmoe",
    group: Annotated[str | None, typer.Option("--group", help="service group (default: same as --user)")] = None,
    dest: Annotated[
        Path | None,
        typer.Option("--dest", help="write vismmoe-edge.service and vismmoe-edge.env into DIR instead of /etc"),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="overwrite an existing environment file")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="print the unit and env file; write nothing")] = False,
) -> None:
    """Install the systemd unit (Type=notify, watchdog, hardening) and its environment file for this venv."""
    settings = {
        "VISMMOE_EDGE_MEMORY_BUDGET": memory_budget,
        "VISMMOE_EDGE_TIER": tier,
        "VISMMOE_EDGE_PREDICTOR": predictor,
        "VISMMOE_EDGE_POLICY": policy,
        "VISMMOE_EDGE_COMPRESSOR": compressor,
        "VISMMOE_EDGE_KEEP_RATIO": str(keep_ratio),
        "VISMMOE_EDGE_PROFILE": profile,
        "VISMMOE_EDGE_LISTEN": listen,
    }
    if pinned_layers is not None:  # omitted from the unit otherwise: serve then takes the plan's
        settings["VISMMOE_EDGE_EXTRA_ARGS"] = f"--pinned-layers {pinned_layers}"
    try:
        result = install_service(
            model=model, dest=dest, user=user, group=group, settings=settings, force=force, dry_run=dry_run
        )
    except VismmoeError as e:
        raise fail(str(e)) from None
    if dry_run:
        typer.echo(f"# ---- {DEFAULT_UNIT_DIR / UNIT_NAME if dest is None else dest / UNIT_NAME}")
        typer.echo(result.unit_text)
        typer.echo(f"# ---- {DEFAULT_ENV_FILE if dest is None else dest / 'vismmoe-edge.env'}")
        typer.echo(result.env_text)
    else:
        typer.echo(f"wrote {result.unit_path}")
        if result.env_written:
            typer.echo(f"wrote {result.env_path}")
        else:
            typer.echo(f"kept {result.env_path} (it exists; --force overwrites it): check its settings")
    for warning in result.warnings:
        typer.echo(f"warning: {warning}", err=True)
    typer.echo("\nnext:" if not dry_run else "\nto install:")
    for step in result.next_steps:
        typer.echo(f"  {step}")
