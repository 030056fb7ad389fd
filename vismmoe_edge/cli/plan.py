"""`vismmoe-edge plan`: the pinned-prefix depth, cache size and prefetch depth for this machine, and why."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from vismmoe_edge.cli.common import demo_model, fail
from vismmoe_edge.cli.options import DeviceOpt, PlanBitsOpt, PlanDenseBitsOpt, PlanGroupOpt, PrefixCacheOpt
from vismmoe_edge.errors import VismmoeError


def plan_command(
    model_dir: Annotated[
        Path | None, typer.Argument(help="Hugging Face model directory; omit for the built-in demo model")
    ] = None,
    profile: Annotated[str, typer.Option("--profile", help="a profile name, or auto (detect board and mode)")] = "auto",
    json_out: Annotated[bool, typer.Option("--json", help="print one JSON object")] = False,
    l_semantic: Annotated[
        int | None, typer.Option("--l-semantic", min=0, help="lowest pinned depth; default from the profile")
    ] = None,
    c_safe_gib: Annotated[
        float | None, typer.Option("--c-safe-gib", min=0.0, help="headroom kept free (GiB); default from the profile")
    ] = None,
    device: DeviceOpt = "auto",
    bits: PlanBitsOpt = None,
    dense_bits: PlanDenseBitsOpt = None,
    group_size: PlanGroupOpt = None,
    max_context: Annotated[
        int | None, typer.Option("--max-context", min=1, help="positions the KV cache holds (default 4608)")
    ] = None,
    prefix_cache_bytes: PrefixCacheOpt = "auto",
) -> None:
    """Choose the device, tier, pinned-prefix depth, expert-cache size and prefetch depth for this machine (or, with
    a Jetson --profile off the board, for that module's memory), and the memory each part takes; say why."""
    from vismmoe_edge.hardware.profiles import select_profile
    from vismmoe_edge.options import embedding_setting, parse_prefix_cache, plan_gpu
    from vismmoe_edge.planning.plan import GIB, format_plan, make_plan

    try:
        chosen, reason, profile_warnings = select_profile(profile, cuda_available=False if device == "cpu" else None)
        gpu, _here, gpu_note = plan_gpu(device, chosen, named=profile != "auto")
        plan = make_plan(
            model_dir if model_dir is not None else demo_model(),
            chosen,
            l_semantic=l_semantic,
            c_safe=None if c_safe_gib is None else int(c_safe_gib * GIB),
            profile_reason=reason,
            gpu=gpu,
            bits=bits,
            dense_bits=dense_bits,
            group_size=group_size,
            max_context=max_context,
            takes_c_safe_option=True,
            prefix_cache_bytes=parse_prefix_cache(prefix_cache_bytes),
            embedding=embedding_setting(),
        )
    except VismmoeError as e:
        raise fail(str(e)) from None
    plan.warnings[:0] = profile_warnings + ([gpu_note] if gpu_note else [])
    typer.echo(json.dumps(plan.as_dict(), indent=2) if json_out else format_plan(plan))
