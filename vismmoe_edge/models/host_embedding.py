"""The token embedding in pinned, GPU-mapped host memory: a discrete GPU gathers its rows over the bus in place.

A decode token reads one row of the embedding (4 KiB of Qwen3-VL-30B-A3B's 0.58 GiB in bf16), a prompt one row per
token, so keeping the table in GPU memory spends 0.58 GiB of it on ~4 KiB a token. Where experts do not all fit
the GPU, those bytes hold ~66 more expert slots at 30B-A3B's 9 MiB an expert, and every slot is fewer bytes over
the bus a token (docs/decode-on-device.md, "The token embedding in host memory"). The gather stays one CUDA kernel
(`F.embedding` on a CUDA view of the mapped pages, experts/tiers/host_memory.py), so it is captured in the decode
token's graph like the in-HBM one, and the rows are the checkpoint's bytes: tokens are unchanged.

Not where lm_head is tied to the embedding (lm_head reads every row each token: it must stay in GPU memory). On
the CPU the table is in host memory either way ("auto" leaves it as transformers' nn.Embedding there).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.experts.tiers.host_memory import HostMemory
from vismmoe_edge.hardware import cudart
from vismmoe_edge.units import format_bytes


class HostEmbedding(nn.Module):
    """nn.Embedding over rows held in page-locked host memory and read in place by `device`."""

    def __init__(self, rows: torch.Tensor, device: torch.device) -> None:
        super().__init__()
        if rows.dim() != 2:
            raise ValueError(f"an embedding is a 2-D table, not {tuple(rows.shape)}")
        self.num_embeddings, self.embedding_dim = rows.shape
        on_gpu = device.type == "cuda"
        index = (device.index if device.index is not None else torch.cuda.current_device()) if on_gpu else 0
        try:
            self.memory = HostMemory(rows.nbytes, runtime=cudart.runtime() if on_gpu else None, device_index=index)
        except VismmoeError as e:  # its message speaks of expert slots
            raise VismmoeError(
                f"pinning the {format_bytes(rows.nbytes)} token embedding in host memory failed ({e}); free host "
                "memory (the pinned host tier of experts takes the most: --host-tier off)"
            ) from None
        raw = rows.contiguous().view(-1).view(torch.uint8)
        self.memory.cpu_view(0, rows.nbytes).copy_(raw)
        # a plain attribute, not a parameter or buffer: model.to() and state_dict() must leave it where it is
        self.weight = self.memory.view(0, rows.nbytes, device).view(rows.dtype).view(rows.shape)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows in {self.memory.how}"


EMBEDDING_PLACES = ("auto", "host", "device")


def check_embedding_place(place: str, name: str = "embedding") -> None:
    """`name`: what the user set (the loader's `embedding`, or VISMMOE_EMBEDDING for the commands and the daemon)."""
    if place not in EMBEDDING_PLACES:
        raise VismmoeError(f"{name}={place!r}: use one of {', '.join(EMBEDDING_PLACES)}")


def embedding_in_host(place: str, *, device: torch.device, slots_in_gpu: bool, experts_outside_gpu: int) -> bool:
    """Where `embedding` puts the token embedding: "host" / "device" as named (on the CPU both are host memory:
    "host" builds the same module over anonymous memory, which is how the CPU tests exercise it); "auto": host
    memory on CUDA where GPU slots hold fewer than every expert, so that the bytes it frees become slots and the bus
    reads fewer experts a token."""
    check_embedding_place(place)
    if place != "auto":
        return place == "host"
    return device.type == "cuda" and slots_in_gpu and experts_outside_gpu > 0
