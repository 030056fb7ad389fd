"""The package's shape: imports flow one way (no cycle), the CLI is a leaf, modules stay small, --help is light.

How long --help takes is measured, not tested: `python -X importtime -m vismmoe_edge.cli --help` (README).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vismmoe_edge"
MAX_LINES = 600


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every vismmoe_edge module `path` imports, at module level or inside functions.

    `from a.b import c` is an edge to a.b.c when that is a module, else to a.b. The parent packages that Python
    initialises on the way are not edges: they are where a module lives, not what it uses."""
    return imports_of_nodes(list(ast.walk(ast.parse(path.read_text()))), modules)


def imports_of_nodes(nodes: list[ast.AST], modules: set[str]) -> set[str]:
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in modules:
                    found.add(sub)
                elif node.module in modules:
                    found.add(node.module)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the current path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_import_graph_has_no_cycle() -> None:
    modules = package_modules()
    graph = {name: imports_of(path, set(modules)) - {name} for name, path in modules.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def package_of(module: str) -> str:
    """vismmoe_edge.<package> for a module inside a subpackage; a module at the top level is its own node."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 and (PACKAGE / parts[1]).is_dir() else module


def module_level_imports(path: Path, modules: set[str]) -> set[str]:
    """The vismmoe_edge modules `path` imports when it is imported: statements at module level (inside a top-level
    `if` or `try` too, `if TYPE_CHECKING:` included), not those inside functions."""
    tree = ast.parse(path.read_text())
    top: list[ast.stmt] = []
    for node in tree.body:
        top += [n for n in ast.walk(node) if isinstance(n, ast.stmt)] if isinstance(node, (ast.If, ast.Try)) else [node]
    return imports_of_nodes(top, modules)


def test_the_packages_do_not_import_each_other_in_a_loop() -> None:
    """experts, quant, models, compress, planning, ...: each package only uses packages below it (module level)."""
    modules = package_modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        here = package_of(name)
        graph.setdefault(here, set()).update(
            package_of(dep) for dep in module_level_imports(path, set(modules)) if package_of(dep) != here
        )
    for deps in list(graph.values()):
        for dep in deps:
            graph.setdefault(dep, set())
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_find_cycle_finds_one() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_only_the_cli_imports_typer_or_the_cli() -> None:
    modules = package_modules()
    offenders = []
    for name, path in modules.items():
        if name == "vismmoe_edge.cli" or name.startswith("vismmoe_edge.cli."):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            offenders += [f"{name} imports {n}" for n in names if n.split(".")[0] == "typer" or
                          n == "vismmoe_edge.cli" or n.startswith("vismmoe_edge.cli.")]  # fmt: skip
    assert offenders == []


def test_no_module_is_over_600_lines() -> None:
    long = {name: n for name, p in package_modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_runtime_does_not_import_the_test_builders() -> None:
    modules = package_modules()
    users = {
        name
        for name, path in modules.items()
        if not name.startswith("vismmoe_edge.testing")
        and any(dep.startswith("vismmoe_edge.testing") for dep in imports_of(path, set(modules)))
    }
    assert users == set()


def test_analyze_names_every_compressor() -> None:
    from vismmoe_edge.cli.analyze import COMPRESSORS
    from vismmoe_edge.compress.prune import METHODS

    assert COMPRESSORS.split(",") == list(METHODS)


HEAVY = ("torch", "transformers", "PIL", "numpy", "safetensors", "onnxruntime")


@pytest.mark.parametrize("argv", [["--help"], ["run", "--help"], ["serve", "--help"]])
def test_help_imports_nothing_heavy(argv: list[str]) -> None:
    code = (
        "import sys\n"
        f"sys.argv = ['vismmoe-edge', *{argv!r}]\n"
        "from vismmoe_edge.cli import app\n"
        "try:\n    app()\nexcept SystemExit:\n    pass\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert "Usage" in out.stdout
