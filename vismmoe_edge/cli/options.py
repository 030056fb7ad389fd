"""Typer option types shared by the commands, declared once so that every command spells and explains an option
the same way (and defaults it the same way: "auto" leaves it to the plan)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from vismmoe_edge.experts.tiers.registry import tier_help

ModelOpt = Annotated[
    Path | None, typer.Option("--model", help="Hugging Face model directory; omit to use the built-in demo model")
]
ImageOpt = Annotated[list[Path] | None, typer.Option("--image", help="image file; repeat for several")]
InfoBudgetOpt = Annotated[
    str,
    typer.Option("--memory-budget", help="expert bytes kept in memory: a size (2GiB) or a share of all experts (40%)"),
]
BudgetOpt = Annotated[
    str,
    typer.Option(
        "--memory-budget",
        help="expert bytes kept in memory: a size (2GiB), a share of all experts (40%), or auto (plan)",
    ),
]
PinnedOpt = Annotated[
    int | None, typer.Option("--pinned-layers", min=0, help="first N MoE layers stay resident; default: the plan's")
]
ProfileOpt = Annotated[str, typer.Option("--profile", help="board/power-mode profile for the plan: a name or auto")]
TierOpt = Annotated[
    str,
    typer.Option(
        "--tier",
        help=tier_help(),
    ),
]
DeviceOpt = Annotated[str, typer.Option("--device", help="auto, cpu, cuda or cuda:N")]
DtypeOpt = Annotated[str, typer.Option("--dtype", help="auto, float32, bfloat16 or float16")]
PolicyOpt = Annotated[
    str, typer.Option("--policy", help="eviction: lru, or popularity (fewest routed tokens first, then oldest)")
]
PredictorOpt = Annotated[
    str,
    typer.Option(
        "--predictor",
        help="prefetch driver: auto (the learned vismmoe-predictor.onnx beside the model if present, else none), "
        "none, learned, next-layer-gate, previous-token, or a .onnx file",
    ),
]
PrefetchDepthOpt = Annotated[
    int | None,
    typer.Option("--prefetch-depth", min=0, help="MoE layers of predicted experts in flight; default: the plan's"),
]
HostTierOpt = Annotated[
    str,
    typer.Option("--host-tier", help="GPU slots: mirror experts in pinned host RAM: auto (where they fit), on, off"),
]
CompressorOpt = Annotated[
    str,
    typer.Option(
        "--compressor",
        help="visual-token compression after the pinned prefix: none, random, saliency, zip, affinity",
    ),
]
KeepRatioOpt = Annotated[float, typer.Option("--keep-ratio", help="share of each image's visual tokens kept")]
SalientRatioOpt = Annotated[
    float, typer.Option("--salient-ratio", help="affinity: share of visual tokens in the salient core")
]
AffinityWeightOpt = Annotated[
    float, typer.Option("--affinity-weight", help="affinity: lambda in p = saliency - lambda * new-expert share")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object")]
PlanBitsOpt = Annotated[
    int | None, typer.Option("--bits", help="plan the experts as `quantize --bits 4|8` would convert them")
]
PlanDenseBitsOpt = Annotated[
    int | None,
    typer.Option("--dense-bits", help="plan attention, lm_head and MLPs as `quantize --dense-bits 4|8` would"),
]
PlanGroupOpt = Annotated[
    int | None, typer.Option("--group-size", min=2, help="int4 group size of the planned conversion (default 128)")
]
VideoOpt = Annotated[
    list[Path] | None,
    typer.Option("--video", help="a video file (MP4/MOV, WebM/MKV, AVI; needs the video extra); repeat for several"),
]
VideoFramesOpt = Annotated[
    list[str] | None,
    typer.Option("--video-frames", help="image files taken as one clip's frames, comma-separated, in order"),
]
VideoFpsOpt = Annotated[
    float,
    typer.Option("--video-fps", help="frames sampled a second from a video file; for --video-frames, their rate"),
]
VideoMaxFramesOpt = Annotated[
    int, typer.Option("--video-max-frames", min=2, help="frames per clip after sampling; a longer clip is refused")
]
VideoMaxPixelsOpt = Annotated[
    int, typer.Option("--video-max-pixels", min=1, help="pixels of each frame once resized (32x32 per token pair)")
]
PrefixCacheOpt = Annotated[
    str,
    typer.Option(
        "--prefix-cache-bytes",
        help="bound of the cache of images' vision features and prompt-prefix KV reused across requests: a size "
        "(256MiB), 0 (off), or auto (the plan's share: one longest prompt)",
    ),
]
