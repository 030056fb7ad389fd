"""What a user chooses for visual-token compression, checked once; torch-free, so that option parsing, the
daemon's settings and `--help` do not import torch (prune.py applies it)."""

from __future__ import annotations

from dataclasses import dataclass

from vismmoe_edge.errors import VismmoeError

METHODS = ("none", "random", "saliency", "zip", "affinity")


@dataclass
class CompressionConfig:
    """`method` is one of METHODS; ratios are shares of each image's visual tokens."""

    method: str = "none"
    keep_ratio: float = 0.7
    salient_ratio: float = 0.3  # the affinity method's salient core
    affinity_weight: float = 2.0  # lambda in p = s - lambda * Delta
    seed: int = 0  # the random method's generator

    def __post_init__(self) -> None:
        self.validate()  # every caller (run, eval, serve, ...) builds one from user options

    def validate(self) -> None:
        if self.method not in METHODS:
            raise VismmoeError(f"--compressor {self.method!r}: use one of {', '.join(METHODS)}")
        for name, value in (("--keep-ratio", self.keep_ratio), ("--salient-ratio", self.salient_ratio)):
            if not 0.0 < value <= 1.0:
                raise VismmoeError(f"{name} {value}: must be in (0, 1]")
        if self.affinity_weight < 0:
            raise VismmoeError(f"--affinity-weight {self.affinity_weight}: must be >= 0")

    @property
    def needs_saliency(self) -> bool:
        return self.method in ("saliency", "zip", "affinity")
