"""vismmoe-edge: run vision-language Mixture-of-Experts models larger than memory.

    import vismmoe_edge
    engine = vismmoe_edge.load("Qwen3-VL-30B-A3B-Instruct", memory_budget="8GiB", pinned_layers=4)
    result = engine.generate("What is in the picture?", images=["photo.jpg"], on_text=print)

Attributes are imported on first use so that `import vismmoe_edge` (and the CLI's --help) stays fast.
"""

from typing import Any

from vismmoe_edge.errors import VismmoeError

__version__ = "0.1.0"
__all__ = ["SamplingConfig", "VismmoeError", "__version__", "load"]


def __getattr__(name: str) -> Any:
    if name == "load":
        from vismmoe_edge.loader import load

        return load
    if name == "SamplingConfig":
        from vismmoe_edge.sampling import SamplingConfig

        return SamplingConfig
    raise AttributeError(f"module 'vismmoe_edge' has no attribute {name!r}")
