"""Routing traces: which experts each token chose at each MoE layer.

Two on-disk formats are read by `load_trace`:

* `.npz` with the keys `expert_ids [T, L, k]`, `prompt_offsets [P+1]`, `prompt_ids [P]`, `moe_layer_ids [L]`
  (the DeepSeek-V2-Lite measurement trace; 64 experts unless the file has a `num_experts` key). Such files are
  always passed in by path: they are never bundled with the project.
* our own JSONL, written by `TraceWriter` (`vismmoe-edge run --trace-out FILE.jsonl`). One JSON object per line:

      {"type": "header", "model": "...", "num_experts": E, "moe_layers": [L0, L1, ...], "top_k": k}
      {"type": "step", "request": r, "phase": "prefill" | "decode", "token_index": i,
       "layers": [{"layer": L, "experts": [[k ids], ...one list per token...], "hits": h, "misses": m,
                   "stall_ms": s, "compute_ms": c, "bytes_read": b, "prefetched_unused_bytes": u,
                   "resident_bytes": R}, ...]}

  The header comes first and once. A prefill step carries every prompt token's ids (one list per token, in
  order) at every MoE layer; a decode step carries one token. `token_index` is the position of the step's
  first token within its request. `layer` is the model layer index (one of `moe_layers`). Steps of one
  request are contiguous; each request becomes one prompt of the `RoutingTrace`, each token one row.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import IO, Any

import numpy as np

from vismmoe_edge.errors import VismmoeError

DEEPSEEK_NUM_EXPERTS = 64  # the npz format does not store it; DeepSeek-V2-Lite has 64 routed experts
PHASES = ("prefill", "decode")


@dataclass
class RoutingTrace:
    """Expert ids per token and MoE layer. Each `[k]` row is a set: its order carries no meaning."""

    expert_ids: np.ndarray  # uint8 or int16 [tokens, layers, k]
    prompt_offsets: np.ndarray  # int64 [prompts]: first row of each prompt; the last prompt ends at `tokens`
    num_experts: int
    layer_ids: list[int]  # model layer index of each MoE layer (axis 1 of expert_ids)
    source: str
    decode: np.ndarray | None = None  # bool [tokens]: True for generated tokens; None when unknown

    def __post_init__(self) -> None:
        if self.expert_ids.ndim != 3:
            raise ValueError(f"expert_ids must be [tokens, layers, k], got shape {self.expert_ids.shape}")
        if self.expert_ids.shape[1] != len(self.layer_ids):
            raise ValueError(
                f"expert_ids has {self.expert_ids.shape[1]} layers but layer_ids has {len(self.layer_ids)}"
            )
        offsets = np.asarray(self.prompt_offsets, dtype=np.int64)
        if len(offsets) and (offsets[0] != 0 or np.any(np.diff(offsets) <= 0) or offsets[-1] >= self.num_tokens):
            raise ValueError("prompt_offsets must start at 0, increase strictly and stay below the token count")
        if not len(offsets) and self.num_tokens:
            raise ValueError("a trace with tokens needs at least one prompt offset")
        self.prompt_offsets = offsets

    @property
    def num_tokens(self) -> int:
        return int(self.expert_ids.shape[0])

    @property
    def num_layers(self) -> int:
        return int(self.expert_ids.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.expert_ids.shape[2])

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_offsets)

    def prompts(self) -> Iterator[tuple[int, int]]:
        """(start, end) row range of each prompt, in order."""
        ends = [*self.prompt_offsets[1:].tolist(), self.num_tokens]
        yield from zip(self.prompt_offsets.tolist(), ends, strict=True)

    def tokens_for_prompt(self, i: int) -> np.ndarray:
        """The `[n, layers, k]` ids of prompt i."""
        start, end = self._bounds(i)
        return self.expert_ids[start:end]

    def select_prompts(self, indices: Sequence[int], source: str | None = None) -> RoutingTrace:
        """A new trace holding the given prompts, in the given order."""
        bounds = [self._bounds(i) for i in indices]
        rows = np.concatenate([np.arange(a, b) for a, b in bounds]) if bounds else np.zeros(0, dtype=np.int64)
        lengths = np.array([b - a for a, b in bounds], dtype=np.int64)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64) if bounds else lengths
        return RoutingTrace(
            expert_ids=self.expert_ids[rows],
            prompt_offsets=offsets,
            num_experts=self.num_experts,
            layer_ids=list(self.layer_ids),
            source=source or self.source,
            decode=None if self.decode is None else self.decode[rows],
        )

    def split(self, fraction: float = 0.8) -> tuple[RoutingTrace, RoutingTrace]:
        """The first `fraction` of the prompts and the rest (whole prompts, never a prompt cut in two).

        Duplicate prompts would leak across the split: call `dedupe()` first on traces that have them.
        """
        if not 0.0 < fraction < 1.0:
            raise ValueError(f"split fraction must be in (0, 1), got {fraction}")
        if self.num_prompts < 2:
            raise ValueError("a trace with fewer than 2 prompts cannot be split")
        cut = min(max(int(round(fraction * self.num_prompts)), 1), self.num_prompts - 1)
        head = self.select_prompts(range(cut), source=f"{self.source} [prompts :{cut}]")
        tail = self.select_prompts(range(cut, self.num_prompts), source=f"{self.source} [prompts {cut}:]")
        return head, tail

    def dedupe(self) -> RoutingTrace:
        """Drop prompts whose routing is identical to an earlier prompt's (byte-identical copies)."""
        seen: set[bytes] = set()
        keep = []
        for i in range(self.num_prompts):
            digest = self.tokens_for_prompt(i).astype(np.int16).tobytes()
            if digest not in seen:
                seen.add(digest)
                keep.append(i)
        return self.select_prompts(keep, source=f"{self.source} [deduplicated]")

    def _bounds(self, i: int) -> tuple[int, int]:
        if not 0 <= i < self.num_prompts:
            raise IndexError(f"prompt {i} out of range (trace has {self.num_prompts})")
        end = int(self.prompt_offsets[i + 1]) if i + 1 < self.num_prompts else self.num_tokens
        return int(self.prompt_offsets[i]), end


def _id_dtype(num_experts: int) -> type[np.integer]:
    return np.uint8 if num_experts <= 256 else np.int16


# --------------------------------------------------------------------------------------------------------- writing


@dataclass
class LayerRecord:
    """One MoE layer of one step: the routed ids of each token and what the cache did for them."""

    layer: int
    experts: Any  # [tokens, k] ids: nested lists or an integer array
    hits: int = 0
    misses: int = 0
    stall_ms: float = 0.0
    compute_ms: float = 0.0
    bytes_read: int = 0
    prefetched_unused_bytes: int = 0
    resident_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # further per-layer fields, written as they are


class TraceWriter:
    """Writes the JSONL trace format described in this module's docstring, one flushed line per record."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self._file: IO[str] | None = open(self.path, "w", encoding="utf-8", newline="\n")
        except OSError as exc:
            raise VismmoeError(f"cannot write trace {self.path}: {exc.strerror}") from exc
        self._layers: list[int] | None = None
        self._top_k = 0

    def header(self, *, model: str, num_experts: int, moe_layers: Sequence[int], top_k: int) -> None:
        if self._layers is not None:
            raise ValueError("the trace header is written once")
        self._layers = [int(x) for x in moe_layers]
        self._top_k = int(top_k)
        self._write(
            {
                "type": "header",
                "model": model,
                "num_experts": int(num_experts),
                "moe_layers": self._layers,
                "top_k": self._top_k,
            }
        )

    def step(
        self, *, request: int, phase: str, token_index: int, layers: Sequence[LayerRecord | Mapping[str, Any]]
    ) -> None:
        if self._layers is None:
            raise ValueError("write the header before the first step")
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
        records = []
        for item in layers:
            rec = item if isinstance(item, LayerRecord) else _layer_record(item)
            experts = np.asarray(rec.experts, dtype=np.int64)
            if experts.ndim != 2 or experts.shape[1] != self._top_k:
                raise ValueError(f"layer {rec.layer}: experts must be [tokens, {self._top_k}], got {experts.shape}")
            if phase == "decode" and experts.shape[0] != 1:
                raise ValueError(f"layer {rec.layer}: a decode step carries one token, got {experts.shape[0]}")
            out = asdict(rec)
            extra = out.pop("extra")
            out["experts"] = experts.tolist()
            records.append({**out, **extra})
        self._write(
            {
                "type": "step",
                "request": int(request),
                "phase": phase,
                "token_index": int(token_index),
                "layers": records,
            }
        )

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, obj: dict[str, Any]) -> None:
        if self._file is None:
            raise ValueError(f"trace {self.path} is closed")
        self._file.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self._file.flush()  # a crashed run still leaves every completed step readable


def _layer_record(item: Mapping[str, Any]) -> LayerRecord:
    """A LayerRecord from a plain mapping; keys that are not LayerRecord fields go to `extra`."""
    known = {f.name for f in fields(LayerRecord)} - {"extra"}
    extra = {**item.get("extra", {}), **{k: v for k, v in item.items() if k not in known and k != "extra"}}
    return LayerRecord(**{k: v for k, v in item.items() if k in known}, extra=extra)


# --------------------------------------------------------------------------------------------------------- reading


def load_trace(path: str | Path) -> RoutingTrace:
    """Read a `.npz` (DeepSeek measurement layout) or `.jsonl` (TraceWriter) trace; VismmoeError if it is bad."""
    path = Path(path)
    if not path.is_file():
        raise VismmoeError(f"trace {path} does not exist or is not a file")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise VismmoeError(f"cannot read trace {path}: {exc.strerror}") from exc
    if magic.startswith(b"PK"):  # npz files are zip archives
        return _load_npz(path)
    return _load_jsonl(path)


def _load_npz(path: Path) -> RoutingTrace:
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = [k for k in ("expert_ids", "prompt_offsets", "moe_layer_ids") if k not in data.files]
            if missing:
                raise VismmoeError(f"trace {path} lacks the npz key(s) {', '.join(missing)}; expected a routing trace")
            ids = data["expert_ids"]
            offsets = data["prompt_offsets"].astype(np.int64)
            layer_ids = [int(x) for x in data["moe_layer_ids"]]
            num_experts = int(data["num_experts"]) if "num_experts" in data.files else DEEPSEEK_NUM_EXPERTS
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise VismmoeError(f"trace {path} is not a readable npz file: {exc}") from exc
    if ids.ndim != 3 or ids.shape[1] != len(layer_ids) or not np.issubdtype(ids.dtype, np.integer):
        raise VismmoeError(
            f"trace {path}: expert_ids has shape {ids.shape} ({ids.dtype}), expected [tokens, "
            f"{len(layer_ids)}, k] integers"
        )
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= num_experts):
        raise VismmoeError(f"trace {path}: expert ids outside 0..{num_experts - 1}")
    # The file stores P+1 boundaries (the last one is the token count); RoutingTrace keeps the P starts.
    if len(offsets) < 2 or offsets[0] != 0 or offsets[-1] != ids.shape[0] or np.any(np.diff(offsets) <= 0):
        raise VismmoeError(f"trace {path}: prompt_offsets must rise strictly from 0 to {ids.shape[0]}")
    return RoutingTrace(
        expert_ids=ids.astype(_id_dtype(num_experts), copy=False),
        prompt_offsets=offsets[:-1],
        num_experts=num_experts,
        layer_ids=layer_ids,
        source=str(path),
        decode=np.zeros(ids.shape[0], dtype=bool),  # the measurement trace is prefill only
    )


def _load_jsonl(path: Path) -> RoutingTrace:
    header: dict[str, Any] | None = None
    rows: list[np.ndarray] = []  # one [n, L, k] block per step
    decode: list[bool] = []
    offsets: list[int] = []
    done_requests: set[int] = set()
    current: int | None = None
    tokens = 0
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                where = f"trace {path} line {lineno}"
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise VismmoeError(f"{where}: not JSON ({exc.msg}); expected a .npz or TraceWriter .jsonl") from exc
                kind = obj.get("type") if isinstance(obj, dict) else None
                if header is None:
                    if kind != "header":
                        raise VismmoeError(f"{where}: the first record must be the header, got type {kind!r}")
                    header = _check_header(obj, where)
                    continue
                if kind != "step":
                    raise VismmoeError(f"{where}: expected a step record, got type {kind!r}")
                request, block, is_decode = _parse_step(obj, header, where)
                if request != current:
                    if request in done_requests:
                        raise VismmoeError(f"{where}: request {request} resumes after another request started")
                    if current is not None:
                        done_requests.add(current)
                    current = request
                    offsets.append(tokens)
                rows.append(block)
                decode.extend([is_decode] * len(block))
                tokens += len(block)
    except UnicodeDecodeError as exc:
        raise VismmoeError(f"trace {path} is neither an npz archive nor UTF-8 JSONL") from exc
    except OSError as exc:
        raise VismmoeError(f"cannot read trace {path}: {exc.strerror}") from exc
    if header is None:
        raise VismmoeError(f"trace {path} is empty: no header record")
    num_layers, k = len(header["moe_layers"]), header["top_k"]
    ids = np.concatenate(rows) if rows else np.zeros((0, num_layers, k))
    return RoutingTrace(
        expert_ids=ids.astype(_id_dtype(header["num_experts"])),
        prompt_offsets=np.array(offsets, dtype=np.int64),
        num_experts=header["num_experts"],
        layer_ids=list(header["moe_layers"]),
        source=f"{path} ({header['model']})",
        decode=np.array(decode, dtype=bool),
    )


def _check_header(obj: dict[str, Any], where: str) -> dict[str, Any]:
    try:
        header = {
            "model": str(obj["model"]),
            "num_experts": int(obj["num_experts"]),
            "moe_layers": [int(x) for x in obj["moe_layers"]],
            "top_k": int(obj["top_k"]),
        }
    except (KeyError, TypeError, ValueError) as exc:
        raise VismmoeError(f"{where}: header needs model, num_experts, moe_layers and top_k ({exc!r})") from exc
    if header["num_experts"] < 1 or header["top_k"] < 1 or not header["moe_layers"]:
        raise VismmoeError(f"{where}: header has no experts, no layers or top_k < 1")
    return header


def _parse_step(obj: dict[str, Any], header: dict[str, Any], where: str) -> tuple[int, np.ndarray, bool]:
    """(request, ids [n, L, k] in header layer order, is_decode) of one step record."""
    layer_index = {layer: i for i, layer in enumerate(header["moe_layers"])}
    try:
        request, phase, layers = int(obj["request"]), obj["phase"], obj["layers"]
        int(obj["token_index"])
        per_layer = {int(rec["layer"]): np.asarray(rec["experts"], dtype=np.int64) for rec in layers}
    except (KeyError, TypeError, ValueError) as exc:
        raise VismmoeError(
            f"{where}: step needs request, phase, token_index and layers[layer, experts] ({exc!r})"
        ) from exc
    if phase not in PHASES:
        raise VismmoeError(f"{where}: phase must be prefill or decode, got {phase!r}")
    if len(per_layer) != len(layers) or set(per_layer) != set(layer_index):
        raise VismmoeError(f"{where}: step must list each of the layers {header['moe_layers']} once")
    k = header["top_k"]
    shapes = {arr.shape for arr in per_layer.values()}
    shape = shapes.pop() if len(shapes) == 1 else ()
    if len(shape) != 2 or shape[0] < 1 or shape[1] != k:
        raise VismmoeError(f"{where}: every layer's experts must be the same [tokens, {k}] list of lists")
    if phase == "decode" and shape[0] != 1:
        raise VismmoeError(f"{where}: a decode step must carry exactly one token, got {shape[0]}")
    block = np.stack([per_layer[layer] for layer in header["moe_layers"]], axis=1)
    if block.min() < 0 or block.max() >= header["num_experts"]:
        raise VismmoeError(f"{where}: expert ids outside 0..{header['num_experts'] - 1}")
    return request, block, phase == "decode"


# ------------------------------------------------------------------------------------------------------- synthetic


def synthetic_trace(
    tokens: int,
    layers: int,
    experts: int,
    k: int,
    *,
    locality: float,
    seed: int,
    prompts: int = 1,
    skew: float = 1.0,
) -> RoutingTrace:
    """A random trace with controllable temporal locality.

    Within a prompt, each of the previous token's k experts at a layer is kept with probability `locality`;
    the remaining slots are drawn without replacement from that layer's popularity, a Zipf law with exponent
    `skew` over a random permutation of the experts. The first token of each prompt is drawn fresh.
    locality=1 repeats the first token's sets; locality=0 gives independent tokens. Prompts have near-equal length.
    """
    if not 0.0 <= locality <= 1.0:
        raise ValueError(f"locality must be in [0, 1], got {locality}")
    if not 1 <= k <= experts:
        raise ValueError(f"need 1 <= k <= experts, got k={k}, experts={experts}")
    if not 1 <= prompts <= max(tokens, 1):
        raise ValueError(f"need 1 <= prompts <= tokens, got {prompts} prompts for {tokens} tokens")
    rng = np.random.default_rng(seed)
    ranks = np.stack([rng.permutation(experts) for _ in range(layers)])  # [L, E]: rank of each expert
    log_pop = -skew * np.log1p(ranks)  # log of the unnormalised Zipf weight 1 / (rank + 1)^skew
    offsets = (np.arange(prompts) * tokens) // prompts
    starts = np.zeros(tokens, dtype=bool)
    starts[offsets] = True
    ids = np.empty((tokens, layers, k), dtype=_id_dtype(experts))
    rows = np.arange(layers)[:, None]
    prev = np.zeros((layers, k), dtype=np.int64)
    for t in range(tokens):
        # Gumbel top-k samples k experts without replacement, proportionally to popularity; kept experts get +inf.
        scores = log_pop - np.log(-np.log(rng.random((layers, experts))))
        if not starts[t]:
            keep = rng.random((layers, k)) < locality
            scores[np.broadcast_to(rows, (layers, k))[keep], prev[keep]] = np.inf
        prev = np.sort(np.argpartition(-scores, k - 1, axis=1)[:, :k], axis=1)
        ids[t] = prev
    return RoutingTrace(
        expert_ids=ids,
        prompt_offsets=offsets.astype(np.int64),
        num_experts=experts,
        layer_ids=list(range(layers)),
        source=f"synthetic(tokens={tokens}, layers={layers}, experts={experts}, k={k}, locality={locality}, "
        f"seed={seed}, prompts={prompts}, skew={skew})",
        decode=np.zeros(tokens, dtype=bool),
    )
