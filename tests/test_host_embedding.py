"""The token embedding in (mapped) host memory: transformers' tokens, where "auto" puts it, and its refusals."""

from __future__ import annotations

import pytest
import torch

import vismmoe_edge
from tests.hf_reference import assert_matches
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.models.host_embedding import HostEmbedding, embedding_in_host

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize("static", [False, True])
def test_host_embedding_matches_transformers(checkpoints, references, static: bool) -> None:
    """The table copied out of the shard into host memory of our own, gathered there: identical tokens and logits
    (the eager prefill and decode, and the static-cache decoder CUDA graphs replay)."""
    engine = vismmoe_edge.load(checkpoints["v5"], memory_budget="25%", device="cpu", tier="host", embedding="host")
    embed = engine.model.model.language_model.embed_tokens
    assert isinstance(embed, HostEmbedding)
    # not a parameter or buffer: model.to() and state_dict() leave the mapped table where it is
    assert not any(name.endswith("embed_tokens.weight") for name in engine.model.state_dict())
    if static:
        engine.static_decode = "on"
        assert engine.uses_static_decode()
    assert_matches(engine, references, static=static, atol=1e-5)


def test_the_rows_are_the_checkpoints(checkpoints) -> None:
    host = vismmoe_edge.load(checkpoints["v5"], memory_budget="25%", device="cpu", tier="host", embedding="host")
    plain = vismmoe_edge.load(checkpoints["v5"], memory_budget="25%", device="cpu", tier="host")
    ours = host.model.model.language_model.embed_tokens
    theirs = plain.model.model.language_model.embed_tokens
    assert isinstance(theirs, torch.nn.Embedding)  # "auto" on the CPU: transformers' own module
    assert torch.equal(ours.weight, theirs.weight)
    ids = torch.tensor([[0, 5, ours.num_embeddings - 1, 5]])
    assert torch.equal(ours(ids), theirs(ids))


def test_auto_puts_it_in_host_memory_only_where_gpu_slots_miss() -> None:
    def place(where: str, device: torch.device, slots_in_gpu: bool = True, outside: int = 1) -> bool:
        return embedding_in_host(where, device=device, slots_in_gpu=slots_in_gpu, experts_outside_gpu=outside)

    assert place("auto", CUDA)  # GPU slots that miss: its GPU memory becomes slots
    assert not place("auto", CUDA, outside=0)  # every expert in GPU memory: nothing to gain, a bus read a token
    assert not place("auto", CUDA, slots_in_gpu=False)  # slots in host memory (a Jetson's unified tiers)
    assert not place("auto", CPU)
    assert place("host", CUDA, outside=0) and place("host", CPU)  # named: as named
    assert not place("device", CUDA)


def test_a_bad_place_fails_before_any_work(checkpoints, monkeypatch: pytest.MonkeyPatch) -> None:
    import vismmoe_edge.loader as loader

    def never(*args, **kwargs):
        raise AssertionError("the runtime was built before the option was checked")

    monkeypatch.setattr(loader, "build_runtime", never)
    with pytest.raises(VismmoeError, match=r"^embedding='gpu': use one of auto, host, device$"):
        vismmoe_edge.load(checkpoints["v5"], device="cpu", embedding="gpu")
