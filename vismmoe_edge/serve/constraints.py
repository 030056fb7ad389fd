"""Logits processors for the request fields that change sampling: logit_bias, presence and frequency penalties,
and response_format (JSON, enforced token by token with llguidance).

Each processor is called by the Sampler with the tokens generated so far and the step's float32 CPU logits, and
returns the logits to sample from (vismmoe_edge/sampling.py). This module imports torch: the worker imports it
only when a request needs it.

llguidance (Microsoft's low-level guidance, Rust; used by vLLM, SGLang and llama.cpp) computes the set of tokens
that keep the output inside a JSON Schema in tens of microseconds per token, has abi3 wheels for aarch64 and
x86_64 and no dependencies (docs/benchmarks.md, "Constrained decoding", compares it with outlines-core and
lm-format-enforcer on the demo model).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter, OrderedDict
from typing import Any

import numpy as np
import torch

from vismmoe_edge.serve.protocol import ApiError, bad_request

log = logging.getLogger("vismmoe_edge.serve")
# Compact JSON: a grammar that allows free whitespace lets a small model emit spaces until max_tokens.
GRAMMAR_DEFAULTS = {"whitespace_flexible": False}
# A schema's cost is bounded before llguidance sees it (an 8.9 MB `pattern` took 7.75 s and 1.1 GiB to refuse;
# 200k properties or a 300k-value enum +140-250 MiB), and llguidance's own parser limits bound the rest.
# OpenAI's structured outputs allow 5,000 properties and 1,000 enum values in all, and 120,000 characters of
# names and values (https://platform.openai.com/docs/guides/structured-outputs, "Supported schemas"); these are
# a little wider.
MAX_SCHEMA_BYTES = 256 * 1024  # the schema as JSON
MAX_SCHEMA_NODES = 20_000  # JSON values in the schema (bounded_json.py reserves them in a body's budget)
MAX_SCHEMA_STRING = 4096  # one string in it: a pattern, a name, an enum value
PARSER_LIMITS = dict(  # llguidance's LLParserLimits: smaller than its defaults, errors without parser state
    max_grammar_size=100_000,  # symbols (default 500,000)
    max_lexer_states=20_000,  # ~1-2 kB each (default 250,000: up to 500 MB)
    initial_lexer_fuel=1_000_000,  # ~20 ms of regex analysis (the default)
    verbose_errors=False,  # an error must not carry the parser's state or the grammar to the client
)
GRAMMAR_CACHE = 64  # compiled grammars kept, by the schema's hash


class LogitBias:
    def __init__(self, bias: dict[int, float]) -> None:
        self.ids = torch.tensor(list(bias), dtype=torch.long)
        self.values = torch.tensor(list(bias.values()), dtype=torch.float32)

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[self.ids] += self.values
        return logits


class Penalties:
    """OpenAI's: logit[j] -= frequency * count[j] + presence * (count[j] > 0), over the tokens generated so far."""

    def __init__(self, presence: float, frequency: float) -> None:
        self.presence = presence
        self.frequency = frequency
        self.counts: Counter[int] = Counter()
        self.seen = 0

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.counts.update(generated[self.seen :])
        self.seen = len(generated)
        if self.counts:
            ids = torch.tensor(list(self.counts), dtype=torch.long)
            counts = torch.tensor(list(self.counts.values()), dtype=torch.float32)
            logits[ids] -= self.frequency * counts + self.presence
        return logits


class JsonGrammars:
    """What one model's tokenizer needs for JSON constraints, built once per daemon."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_ids: list[int]) -> None:
        try:
            import llguidance
            import llguidance.hf
        except ImportError:  # pragma: no cover - a dependency of the package
            raise bad_request(
                "response_format needs the llguidance package: pip install llguidance", "response_format"
            ) from None
        self.llguidance = llguidance
        self.vocab_size = vocab_size
        self.stop_ids = list(stop_ids)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=self.stop_ids or None)
        self.limits = llguidance.LLParserLimits(**PARSER_LIMITS)
        self.cache: OrderedDict[str, str] = OrderedDict()  # sha256 of the schema's JSON -> grammar

    def compile(self, response_format: dict[str, Any]) -> str:
        """The grammar for a parsed response_format (cached by the schema's hash); a schema that is too large,
        recursive without end, unsatisfiable, unsupported or invalid is a 400 that says which."""
        schema = response_format.get("schema") if response_format["type"] == "json_schema" else {"type": "object"}
        text = json.dumps(schema, sort_keys=True)
        key = hashlib.sha256(text.encode()).hexdigest()
        if (grammar := self.cache.get(key)) is not None:
            self.cache.move_to_end(key)
            return grammar
        check_schema_size(schema, len(text))
        if not has_finite_instance(schema):
            raise schema_error(
                "it admits no finite JSON value (a $ref, required property or item refers back to itself without "
                "end, or nothing is allowed)"
            )
        matcher_cls = self.llguidance.LLMatcher
        try:
            grammar = matcher_cls.grammar_from_json_schema(text, defaults=GRAMMAR_DEFAULTS)
            is_error, messages = matcher_cls.validate_grammar_with_warnings(grammar, self.tokenizer, limits=self.limits)
        except (ValueError, TypeError, RuntimeError) as e:
            raise schema_error(first_line(str(e))) from None
        if is_error:
            raise schema_error(first_line("; ".join(messages)))
        self.cache[key] = grammar
        if len(self.cache) > GRAMMAR_CACHE:
            self.cache.popitem(last=False)
        return grammar

    def processor(self, grammar: str) -> JsonConstraint:
        return JsonConstraint(self, grammar)


class JsonConstraint:
    """Masks every token that would leave the grammar; once the JSON is complete, only a stop token is left."""

    def __init__(self, grammars: JsonGrammars, grammar: str) -> None:
        self.matcher = grammars.llguidance.LLMatcher(grammars.tokenizer, grammar, limits=grammars.limits)
        self.stop_ids = torch.tensor(grammars.stop_ids, dtype=torch.long)
        self.vocab_size = grammars.vocab_size
        self.bitmask = np.full((grammars.vocab_size + 31) // 32, -1, dtype=np.int32)
        self.seen = 0

    def __call__(self, generated: list[int], logits: torch.Tensor) -> torch.Tensor:
        for token in generated[self.seen :]:
            if not self.matcher.consume_token(token):  # the parser's message is for the log, not the client
                log.warning("constrained decoding failed: %s", self.matcher.get_error()[:500])
                raise ApiError(
                    500,
                    "constrained decoding could not continue within the schema",
                    type="server_error",
                    code="constraint_error",
                )
        self.seen = len(generated)
        if self.matcher.is_stopped():  # complete: nothing may follow
            allowed = torch.zeros(logits.shape[0], dtype=torch.bool)
        else:
            self.matcher.unsafe_compute_mask_ptr(self.bitmask.ctypes.data, self.bitmask.nbytes)
            bits = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[: logits.shape[0]]
            allowed = torch.from_numpy(bits.astype(bool))
            if allowed.shape[0] < logits.shape[0]:
                allowed = torch.cat([allowed, torch.zeros(logits.shape[0] - allowed.shape[0], dtype=torch.bool)])
        if self.matcher.is_accepting() or self.matcher.is_stopped():
            allowed[self.stop_ids] = True  # the model's own stop tokens end a complete reply
        logits.masked_fill_(~allowed, float("-inf"))
        return logits


def schema_error(reason: str) -> ApiError:
    return bad_request(f"response_format: the schema cannot be used: {reason}", "response_format.json_schema.schema")


def first_line(text: str) -> str:
    """An error's first line, cut short: enough to say what is wrong, never a dump of internal state."""
    return (text.strip().splitlines() or ["invalid schema"])[0][:200]


def check_schema_size(schema: Any, size: int) -> None:
    if size > MAX_SCHEMA_BYTES:
        raise schema_error(f"it is {size} bytes of JSON, more than {MAX_SCHEMA_BYTES}")
    nodes = 0
    stack = [schema]
    while stack:
        value = stack.pop()
        nodes += 1
        if isinstance(value, dict):
            for key, child in value.items():
                if len(key) > MAX_SCHEMA_STRING:
                    raise schema_error(f"a name of {len(key)} characters (the limit is {MAX_SCHEMA_STRING})")
                stack.append(child)
        elif isinstance(value, list):
            stack.extend(value)
        elif isinstance(value, str) and len(value) > MAX_SCHEMA_STRING:
            raise schema_error(f"a string of {len(value)} characters (the limit is {MAX_SCHEMA_STRING})")
    if nodes > MAX_SCHEMA_NODES:
        raise schema_error(f"it has {nodes} JSON values, more than {MAX_SCHEMA_NODES}")


def resolve_ref(root: Any, ref: str) -> Any:
    """A local $ref ("#", "#/$defs/name", any JSON pointer into the schema); None for anything else."""
    if not ref.startswith("#"):
        return None
    node = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def subschema_children(schema: dict[str, Any], root: Any) -> list[Any]:
    """The subschemas whose finiteness `schema`'s may depend on (a $ref's target included)."""
    children: list[Any] = []
    if isinstance(schema.get("$ref"), str):
        target = resolve_ref(root, schema["$ref"])
        if target is not None:
            children.append(target)
    for key in ("allOf", "anyOf", "oneOf", "prefixItems"):
        if isinstance(schema.get(key), list):
            children.extend(schema[key])
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), (dict, bool)):
            children.append(schema[key])
    if isinstance(schema.get("properties"), dict):
        children.extend(schema["properties"].values())
    return children


def has_finite_instance(root: Any) -> bool:
    """Whether some finite JSON value satisfies the schema, as far as its structure says: the least fixed point of
    "finite" over its subschemas, so that {"$ref": "#"}, a -> b -> a, or an object that requires a child of its
    own kind are found to have none, while a tree whose children are optional has one. Keywords it does not
    model (patterns, bounds, not) count as satisfiable: llguidance judges those."""
    order: list[Any] = []  # dict subschemas, children before parents
    seen: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if not isinstance(node, dict):
            continue
        if expanded:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in subschema_children(node, root))
    finite: dict[int, bool] = {id(node): False for node in order}

    def ok(schema: Any) -> bool:
        if isinstance(schema, bool):
            return schema
        return finite.get(id(schema), True) if isinstance(schema, dict) else True

    changed = True
    while changed:  # monotone: each pass can only turn False into True, so it ends
        changed = False
        for node in order:
            if not finite[id(node)] and finite_now(node, root, ok):
                finite[id(node)] = True
                changed = True
    return ok(root)


def finite_now(schema: dict[str, Any], root: Any, ok: Any) -> bool:
    if "$ref" in schema and isinstance(schema["$ref"], str):
        target = resolve_ref(root, schema["$ref"])
        if target is not None and not ok(target):
            return False
    if "enum" in schema and isinstance(schema["enum"], list) and not schema["enum"]:
        return False
    if isinstance(schema.get("allOf"), list) and not all(ok(s) for s in schema["allOf"]):
        return False
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list) and not any(ok(s) for s in schema[key]):
            return False
    if "const" in schema or "enum" in schema:
        return True
    types = schema.get("type")
    types = types if isinstance(types, list) else [types] if isinstance(types, str) else None
    if types is not None and not types:
        return False
    return any(type_finite(schema, kind, ok) for kind in (types or [None]))


def type_finite(schema: dict[str, Any], kind: str | None, ok: Any) -> bool:
    if kind == "object" or (kind is None and ("properties" in schema or "required" in schema)):
        properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
        extra = schema.get("additionalProperties", True)
        required = schema.get("required") if isinstance(schema.get("required"), list) else []
        return all(ok(properties.get(name, extra)) for name in required if isinstance(name, str))
    if kind == "array" or (kind is None and "items" in schema and "minItems" in schema):
        least = schema.get("minItems", 0)
        if not isinstance(least, int) or least <= 0:
            return True
        prefix = schema.get("prefixItems") if isinstance(schema.get("prefixItems"), list) else []
        needed = prefix[:least]
        if least > len(prefix):
            needed.append(schema.get("items", True))
        return all(ok(s) for s in needed)
    return True
