"""The CUDA-graph capture stream is never a stream an I/O thread copies on (the `invalid argument` crash of
SlotPoolTier.ready): a static check that runs without a GPU.

torch gives out low-priority streams round-robin from a pool of 32, so any two `torch.cuda.Stream()` calls may be
the same CUDA stream. The decoder captures on one stream from the high-priority pool (static_decode.capture_stream),
and a captured token forks its lookahead onto a second one taken there too (purpose "lookahead"); this holds only
while no other stream in the package is high-priority and every capture names the capture stream.
"""

from __future__ import annotations

import ast
from pathlib import Path

import vismmoe_edge

PACKAGE = Path(vismmoe_edge.__file__).parent


def _calls(name: str) -> list[tuple[Path, ast.Call]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and ast.unparse(node.func) == name:
                found.append((path, node))
    return found


def test_only_the_capture_stream_is_high_priority() -> None:
    streams = _calls("torch.cuda.Stream")
    assert streams, "the scan found no stream at all: it is not looking at the package"
    high = [(p.name, n.lineno) for p, n in streams if any(k.arg == "priority" for k in n.keywords) or len(n.args) > 1]
    assert high == [("static_decode.py", next(n.lineno for p, n in streams if p.name == "static_decode.py"))], high


def test_every_capture_names_the_capture_stream() -> None:
    """Every `torch.cuda.graph(...)` passes `stream=side`, and the function around it took `side` from
    `capture_stream(...)` (the decoder's graphs, and the prompt suffix's: suffix_graph.py)."""
    captures = _calls("torch.cuda.graph")
    assert {p.name for p, _ in captures} == {"static_decode.py", "suffix_graph.py"}
    for path, node in captures:
        stream = [k.value for k in node.keywords if k.arg == "stream"]
        assert stream and ast.unparse(stream[0]) == "side", f"{path.name}:{node.lineno} captures on another stream"
        functions = [f for f in ast.walk(ast.parse(path.read_text())) if isinstance(f, ast.FunctionDef)]
        around = next(f for f in functions if f.lineno <= node.lineno <= (f.end_lineno or 0))
        sources = [
            ast.unparse(a.value)
            for a in ast.walk(around)
            if isinstance(a, ast.Assign) and any(ast.unparse(t) == "side" for t in a.targets)
        ]
        assert sources and all(src.startswith("capture_stream(") for src in sources), (path.name, sources)
