"""vismmoe-edge: run vision-language Mixture-of-Experts models larger than memory.

import vismmoe_edge
engine = vismmoe_edge.load("Qwen3-VL-30B-A3B-Instruct", memory_budget="8GiB", pinned_layers=4)
result = engine.generate("What is in the picture?", images=["photo.jpg"], on_text=print)
"""

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.sampling import SamplingConfig

__version__ = "0.1.0"
__all__ = ["SamplingConfig", "VismmoeError", "__version__", "load"]


def load(*args, **kwargs):  # noqa: ANN002, ANN003 - re-exported with its real signature below
    from vismmoe_edge.loader import load as _load

    return _load(*args, **kwargs)


load.__doc__ = "See vismmoe_edge.loader.load."
