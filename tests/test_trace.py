"""Routing traces: our JSONL format, the npz measurement layout (synthetic data only), splits, the generator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.trace import LayerRecord, RoutingTrace, TraceWriter, load_trace, synthetic_trace

LAYERS = [1, 2, 3]


def write_demo_jsonl(path: Path) -> tuple[np.ndarray, list[int]]:
    """Two requests (3-token prompt + 2 decode steps, 2-token prompt + 1 decode step); returns ids and offsets."""
    rng = np.random.default_rng(0)
    rows = []
    with TraceWriter(path) as writer:
        writer.header(model="tiny", num_experts=8, moe_layers=LAYERS, top_k=2)
        for request, (prompt_len, gen) in enumerate([(3, 2), (2, 1)]):
            steps = [("prefill", 0, prompt_len)] + [("decode", prompt_len + j, 1) for j in range(gen)]
            for phase, token_index, n in steps:
                ids = np.stack([rng.choice(8, size=2, replace=False) for _ in range(n * len(LAYERS))])
                ids = ids.reshape(n, len(LAYERS), 2)
                rows.append(ids)
                layers = [
                    LayerRecord(layer=layer, experts=ids[:, li], hits=1, misses=1, stall_ms=0.5, bytes_read=10)
                    for li, layer in enumerate(LAYERS)
                ]
                layers[0] = {"layer": LAYERS[0], "experts": ids[:, 0].tolist(), "hits": 2, "queue_ms": 1.5}  # dicts too
                writer.step(request=request, phase=phase, token_index=token_index, layers=layers)
    return np.concatenate(rows), [0, 5]


def test_jsonl_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    ids, offsets = write_demo_jsonl(path)
    trace = load_trace(path)
    assert trace.expert_ids.shape == (8, 3, 2)
    np.testing.assert_array_equal(trace.expert_ids, ids)
    assert trace.prompt_offsets.tolist() == offsets
    assert (trace.num_experts, trace.layer_ids) == (8, LAYERS)
    assert trace.decode.tolist() == [False] * 3 + [True] * 2 + [False] * 2 + [True]
    assert list(trace.prompts()) == [(0, 5), (5, 8)]
    np.testing.assert_array_equal(trace.tokens_for_prompt(1), ids[5:])
    assert "tiny" in trace.source
    first_line = path.read_text().splitlines()[0]
    assert first_line == '{"type":"header","model":"tiny","num_experts":8,"moe_layers":[1,2,3],"top_k":2}'
    step = json.loads(path.read_text().splitlines()[1])
    assert (step["phase"], step["token_index"], step["layers"][0]["queue_ms"]) == ("prefill", 0, 1.5)
    assert step["layers"][1]["stall_ms"] == 0.5 and "extra" not in step["layers"][1]


def test_writer_rejects_bad_records(tmp_path: Path) -> None:
    with TraceWriter(tmp_path / "w.jsonl") as writer:
        with pytest.raises(ValueError):
            writer.step(request=0, phase="decode", token_index=0, layers=[])
        writer.header(model="m", num_experts=4, moe_layers=[0], top_k=2)
        with pytest.raises(ValueError):
            writer.step(request=0, phase="decode", token_index=0, layers=[LayerRecord(0, [[1, 2], [0, 3]])])
        with pytest.raises(ValueError):
            writer.step(request=0, phase="sample", token_index=0, layers=[LayerRecord(0, [[1, 2]])])


def write_npz(path: Path, **override: np.ndarray) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    arrays = {
        "expert_ids": rng.integers(0, 64, size=(10, 4, 6)).astype(np.uint8),
        "prompt_offsets": np.array([0, 3, 4, 10], dtype=np.int64),
        "prompt_ids": np.array([1, 2, 5], dtype=np.int32),
        "moe_layer_ids": np.arange(1, 5, dtype=np.int16),
    }
    arrays.update(override)
    np.savez(path, **arrays)
    return arrays


def test_npz_loading(tmp_path: Path) -> None:
    arrays = write_npz(tmp_path / "t.npz")
    trace = load_trace(tmp_path / "t.npz")
    np.testing.assert_array_equal(trace.expert_ids, arrays["expert_ids"])
    assert trace.prompt_offsets.tolist() == [0, 3, 4]
    assert list(trace.prompts()) == [(0, 3), (3, 4), (4, 10)]
    assert (trace.num_experts, trace.layer_ids, trace.top_k) == (64, [1, 2, 3, 4], 6)


def test_split_and_dedupe_by_prompts() -> None:
    trace = synthetic_trace(100, 3, 16, 2, locality=0.3, seed=2, prompts=10)
    head, tail = trace.split(0.8)
    assert (head.num_prompts, tail.num_prompts) == (8, 2)
    assert head.num_tokens + tail.num_tokens == 100
    np.testing.assert_array_equal(np.concatenate([head.expert_ids, tail.expert_ids]), trace.expert_ids)
    np.testing.assert_array_equal(tail.tokens_for_prompt(0), trace.tokens_for_prompt(8))
    assert tail.prompt_offsets[0] == 0
    doubled = trace.select_prompts([0, 1, 0, 2, 1])
    assert doubled.dedupe().num_prompts == 3


def consecutive_overlap(trace: RoutingTrace) -> float:
    """Mean share of a token's experts also chosen by the previous token at the same layer (within prompts)."""
    shares = []
    for start, end in trace.prompts():
        ids = trace.expert_ids[start:end].astype(np.int64)
        same = (ids[1:, :, :, None] == ids[:-1, :, None, :]).any(axis=3)
        shares.append(same.mean(axis=2).ravel())
    return float(np.concatenate(shares).mean())


def test_synthetic_locality() -> None:
    sticky = synthetic_trace(200, 4, 32, 4, locality=1.0, seed=3)
    assert (sticky.expert_ids[1:] == sticky.expert_ids[:-1]).all()
    assert all(len(set(row)) == 4 for row in sticky.expert_ids.reshape(-1, 4).tolist())  # sets: no repeats
    fresh = synthetic_trace(2000, 4, 32, 4, locality=0.0, seed=3)
    half = synthetic_trace(2000, 4, 32, 4, locality=0.5, seed=3)
    assert consecutive_overlap(fresh) < consecutive_overlap(half) < consecutive_overlap(sticky) == 1.0
    # The popularity is skewed: the most used expert of a layer beats the uniform share clearly.
    counts = np.bincount(fresh.expert_ids[:, 0].ravel(), minlength=32)
    assert counts.max() > 2 * counts.sum() / 32
    assert synthetic_trace(50, 2, 8, 2, locality=0.5, seed=9).expert_ids.tolist() == (
        synthetic_trace(50, 2, 8, 2, locality=0.5, seed=9).expert_ids.tolist()
    )


@pytest.mark.parametrize(
    "content",
    [
        b"",
        b"not json\n",
        b'{"type": "step"}\n',
        b'{"type": "header", "model": "m", "num_experts": 4, "moe_layers": [0], "top_k": 2}\n{"type": "step"}\n',
        b'{"type": "header", "model": "m", "num_experts": 4, "moe_layers": [0], "top_k": 2}\n'
        b'{"type": "step", "request": 0, "phase": "decode", "token_index": 0, '
        b'"layers": [{"layer": 0, "experts": [[1, 9]]}]}\n',
        b'{"type": "header", "model": "m", "num_experts": 4, "moe_layers": [0, 1], "top_k": 2}\n'
        b'{"type": "step", "request": 0, "phase": "decode", "token_index": 0, '
        b'"layers": [{"layer": 0, "experts": [[1, 2]]}]}\n',
        b"\xff\xfe\x00garbage",
        b"PK\x03\x04 truncated zip",
    ],
)
def test_bad_files_raise_vismmoe_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "bad.trace"
    path.write_bytes(content)
    with pytest.raises(VismmoeError) as info:
        load_trace(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message


def test_bad_npz_and_missing_file(tmp_path: Path) -> None:
    np.savez(tmp_path / "other.npz", weights=np.zeros(3))
    write_npz(tmp_path / "offsets.npz", prompt_offsets=np.array([0, 3, 4, 9]))
    write_npz(tmp_path / "range.npz", expert_ids=np.full((10, 4, 6), 70, dtype=np.uint8))
    for name in ("other.npz", "offsets.npz", "range.npz", "missing.npz"):
        with pytest.raises(VismmoeError, match=name):
            load_trace(tmp_path / name)
    requests = tmp_path / "interleaved.jsonl"
    with TraceWriter(requests) as writer:
        writer.header(model="m", num_experts=4, moe_layers=[0], top_k=1)
        for request in (0, 1, 0):
            writer.step(request=request, phase="decode", token_index=0, layers=[LayerRecord(0, [[request]])])
    with pytest.raises(VismmoeError, match="resumes"):
        load_trace(requests)
