#!/usr/bin/env python3
"""Per-token cost of JSON-constrained decoding: llguidance (what the daemon uses) against outlines-core,
lm-format-enforcer and xgrammar, on the demo model's tokenizer; then the daemon's own processor inside real
decoding on the demo model.

Part 1 (the libraries, like for like): each one is driven through the same valid JSON, token by token (teacher
forcing), and each step does what a decode step needs: compute the set of allowed tokens, mask a float32 logits
vector of the vocabulary's size, advance with the token. Reported: grammar compile time and the median cost of
one step. A library that is not installed is skipped.

Part 2 (end to end): decode on the demo model with and without `response_format: json_object` (our
JsonConstraint processor, through Engine.stream), as seconds per generated token.

    python tools/bench/constrained.py [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"type": "string", "enum": ["red", "green", "blue", "orange", "purple", "yellow", "white"]},
        "shape": {"type": "string", "enum": ["circle", "square", "triangle"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "objects": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"shape": {"type": "string"}, "colour": {"type": "string"}},
                "required": ["shape", "colour"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["colour", "shape", "count", "objects"],
    "additionalProperties": False,
}
TARGET = {
    "colour": "orange",
    "shape": "circle",
    "count": 4,
    "objects": [{"shape": "triangle", "colour": "white"}] * 3 + [{"shape": "circle", "colour": "orange"}],
}


def demo_tokenizer() -> Any:
    from transformers import AutoTokenizer

    from vismmoe_edge.demo import ensure_demo_model

    return AutoTokenizer.from_pretrained(str(ensure_demo_model()))


def large_tokenizer(vocab_size: int, cache: Path) -> Any:
    """A byte-level BPE of `vocab_size` tokens, trained on this Python's own library sources (no download): the
    demo's 472 tokens say little about a real model's 151k. Cached in `cache`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path = cache / f"bpe-{vocab_size}.json"
    if not path.exists():
        import sysconfig

        files = []
        for p in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py"))[:3000]:
            try:
                p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            files.append(str(p))
        bpe = Tokenizer(models.BPE())
        bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        bpe.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=["<|im_end|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        )
        bpe.train(files, trainer)
        cache.mkdir(parents=True, exist_ok=True)
        bpe.save(str(path))
    return PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token="<|im_end|>")


def time_steps(step: Any, tokens: list[int], repeats: int) -> float:
    """Median seconds of one step over `repeats` passes through `tokens` (step(i, token) does one step)."""
    per_pass = []
    for _ in range(repeats):
        start = time.perf_counter()
        for i, token in enumerate(tokens):
            step(i, token)
        per_pass.append((time.perf_counter() - start) / len(tokens))
    return statistics.median(per_pass)


def bench_llguidance(tok: Any, vocab: int, tokens: list[int], repeats: int) -> dict[str, float]:
    from vismmoe_edge.serve.constraints import JsonGrammars

    start = time.perf_counter()
    grammars = JsonGrammars(tok, vocab, [tok.eos_token_id])
    setup_s = time.perf_counter() - start
    grammar = grammars.compile({"type": "json_schema", "schema": SCHEMA})
    grammars.processor(grammar)(  # the matcher builds its parser lazily: count that as compiling
        [], torch.zeros(vocab)
    )
    compile_s = time.perf_counter() - start - setup_s
    state: dict[str, Any] = {}

    def step(i: int, token: int) -> None:
        if i == 0:
            state["c"], state["gen"] = grammars.processor(grammar), []
        logits = torch.zeros(vocab)
        state["c"](state["gen"], logits)  # consumes the previous token, masks this step
        assert logits[token] == 0, "the target left the grammar"
        state["gen"].append(token)

    return {"setup_s": setup_s, "compile_s": compile_s, "step_s": time_steps(step, tokens, repeats)}


def bench_xgrammar(tok: Any, vocab: int, tokens: list[int], repeats: int) -> dict[str, float]:
    import xgrammar as xgr

    start = time.perf_counter()
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab))
    setup_s = time.perf_counter() - start
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(",", ":"))
    compile_s = time.perf_counter() - start - setup_s
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    state: dict[str, Any] = {}

    def step(i: int, token: int) -> None:
        if i == 0:
            state["m"] = xgr.GrammarMatcher(compiled)
        logits = torch.zeros(1, vocab)
        state["m"].fill_next_token_bitmask(bitmask)
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        assert logits[0, token] == 0
        assert state["m"].accept_token(token)

    return {"setup_s": setup_s, "compile_s": compile_s, "step_s": time_steps(step, tokens, repeats)}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet: each byte as a printable character."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs], strict=True))


def byte_vocabulary(tok: Any) -> dict[bytes, list[int]]:
    """Token id -> the bytes it stands for (byte-level BPE), specials left out."""
    decoder = {v: k for k, v in bytes_to_unicode().items()}
    special = set(tok.all_special_ids)
    out: dict[bytes, list[int]] = {}
    for text, index in tok.get_vocab().items():
        if index in special:
            continue
        try:
            out.setdefault(bytes(decoder[c] for c in text), []).append(index)
        except KeyError:
            continue
    return out


def bench_outlines_core(tok: Any, vocab: int, tokens: list[int], repeats: int) -> dict[str, float]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    start = time.perf_counter()
    vocabulary = Vocabulary(tok.eos_token_id, byte_vocabulary(tok))
    setup_s = time.perf_counter() - start
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), vocabulary)
    compile_s = time.perf_counter() - start - setup_s
    state: dict[str, Any] = {}

    def step(i: int, token: int) -> None:
        if i == 0:
            state["g"] = Guide(index)
        logits = torch.zeros(vocab)
        allowed = torch.zeros(vocab, dtype=torch.bool)
        allowed[torch.tensor(state["g"].get_tokens(), dtype=torch.long)] = True
        logits.masked_fill_(~allowed, float("-inf"))
        assert logits[token] == 0
        state["g"].advance(token)

    return {"setup_s": setup_s, "compile_s": compile_s, "step_s": time_steps(step, tokens, repeats)}


def bench_lm_format_enforcer(tok: Any, vocab: int, tokens: list[int], repeats: int) -> dict[str, float]:
    from lmformatenforcer import JsonSchemaParser, TokenEnforcer, TokenEnforcerTokenizerData

    # Its transformers integration does not import under transformers 5; this is what it would build.
    start = time.perf_counter()
    zero = tok.encode("0", add_special_tokens=False)[-1]
    regular = []
    for index in range(vocab):
        if index in tok.all_special_ids:
            continue
        after_zero, alone = tok.decode([zero, index])[1:], tok.decode([index])
        regular.append((index, after_zero, len(after_zero) > len(alone)))
    decode = lambda ids: tok.decode(ids).rstrip("\ufffd")  # noqa: E731
    data = TokenEnforcerTokenizerData(regular, decode, tok.eos_token_id, False, vocab)
    setup_s = time.perf_counter() - start
    compile_s = 0.0  # its parser is built with the enforcer, inside the first step
    state: dict[str, Any] = {}

    def step(i: int, token: int) -> None:
        if i == 0:
            state["e"], state["seq"] = TokenEnforcer(data, JsonSchemaParser(SCHEMA)), []
        logits = torch.zeros(vocab)
        allowed = torch.zeros(vocab, dtype=torch.bool)
        allowed[torch.tensor(state["e"].get_allowed_tokens(state["seq"]).allowed_tokens, dtype=torch.long)] = True
        logits.masked_fill_(~allowed, float("-inf"))
        assert logits[token] == 0
        state["seq"].append(token)

    return {"setup_s": setup_s, "compile_s": compile_s, "step_s": time_steps(step, tokens, repeats)}


def end_to_end(trials: int, tokens: int) -> dict[str, float]:
    """Seconds per decoded token on the demo model, unconstrained and with json_object (our processor)."""
    from vismmoe_edge.options import LoadOptions, load_engine
    from vismmoe_edge.sampling import SamplingConfig
    from vismmoe_edge.serve.constraints import JsonGrammars

    engine, _ = load_engine(None, LoadOptions(device="cpu"))
    tok = engine.processor.tokenizer
    vocab = int(engine.text_config.vocab_size)
    grammars = JsonGrammars(tok, vocab, engine.eos_token_ids)
    grammar = grammars.compile({"type": "json_object"})
    inputs = engine.encode("Describe the shapes.")
    results: dict[str, list[float]] = {"plain": [], "json_object": []}
    for _ in range(trials):
        for name in results:
            processors = [grammars.processor(grammar)] if name == "json_object" else []
            min_new = tokens if name == "plain" else 0
            sampling = SamplingConfig(max_new_tokens=tokens, min_new_tokens=min_new, logits_processors=processors)
            r = engine.generate_from_inputs(inputs, sampling)
            results[name].append(r.timings.decode_s / max(1, r.timings.decode_tokens))
    return {f"{k}_s_per_token": statistics.median(v) for k, v in results.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48, help="decoded tokens per end-to-end trial")
    parser.add_argument("--vocab-size", type=int, help="part 1 on a byte-level BPE of this size instead of the demo's")
    parser.add_argument("--cache", type=Path, default=Path("/tmp/vismmoe-bench-tokenizers"))
    parser.add_argument("--skip-end-to-end", action="store_true")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    tok = large_tokenizer(args.vocab_size, args.cache) if args.vocab_size else demo_tokenizer()
    vocab = len(tok)
    target = tok.encode(json.dumps(TARGET, separators=(",", ":")), add_special_tokens=False)
    print(f"tokenizer: {vocab} tokens; the target JSON is {len(target)} tokens")
    out: dict[str, Any] = {"vocab": vocab, "target_tokens": len(target), "libraries": {}}
    for name, bench in (
        ("llguidance", bench_llguidance),
        ("xgrammar", bench_xgrammar),
        ("outlines-core", bench_outlines_core),
        ("lm-format-enforcer", bench_lm_format_enforcer),
    ):
        try:
            r = bench(tok, vocab, target, args.repeats)
        except ImportError as e:
            print(f"{name:20s} not installed ({e.name})")
            continue
        out["libraries"][name] = r
        print(
            f"{name:20s} setup {r['setup_s'] * 1000:8.1f} ms  compile {r['compile_s'] * 1000:8.1f} ms  "
            f"per token {r['step_s'] * 1e6:8.1f} us"
        )
    if args.skip_end_to_end:
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=2))
        return 0
    e2e = end_to_end(args.trials, args.tokens)
    out["end_to_end"] = e2e
    plain, constrained = e2e["plain_s_per_token"], e2e["json_object_s_per_token"]
    print(f"demo model decode: {plain * 1000:.2f} ms/token plain, {constrained * 1000:.2f} ms/token with json_object "
          f"({(constrained - plain) * 1000:+.2f} ms)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
