"""The package's shape: no module imports itself through others (lazy imports inside functions count, since they
hide the same knot), the configs are leaves that every layer may import, and no function is longer than a screen."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "tokenmill"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package folder `root`."""
    names = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _imported(node: ast.AST, package: str, names: dict[str, Path]) -> list[str]:
    """What one import statement loads: `from pkg import name` names the submodule when there is one, else pkg."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        parent = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(parent + ([node.module] if node.module else []))
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in names else base for a in node.names]


def _imports_of(tree: ast.Module, package: str, names: dict[str, Path]) -> list[str]:
    """Every import the module can execute, at its top or inside its functions; `if TYPE_CHECKING:` blocks never
    run, so they are left out."""
    found, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
            continue
        found += _imported(node, package, names)
        todo.extend(ast.iter_child_nodes(node))
    return found


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports."""
    names = module_names(root)
    graph: dict[str, set[str]] = {m: set() for m in names}
    for mod, path in names.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for target in _imports_of(ast.parse(path.read_text()), package, names):
            while target and target not in names:
                target = target.rpartition(".")[0]
            if target and target != mod:
                graph[mod].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def config_modules(root: Path) -> set[str]:
    """Modules that define a `*Config` dataclass: the settings every layer reads."""
    found = set()
    for mod, path in module_names(root).items():
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.ClassDef) and node.name.endswith("Config")
                    and any("dataclass" in ast.unparse(d) for d in node.decorator_list)):
                found.add(mod)
    return found


def test_the_package_has_no_import_cycles():
    found = cycles(import_graph(PACKAGE))
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_configs_import_only_utils_and_other_configs():
    graph = import_graph(PACKAGE)
    leaves = config_modules(PACKAGE)
    assert {"tokenmill.config", "tokenmill.spec_decode.config", "tokenmill.lora.config",
            "tokenmill.kv_transfer.config"} <= leaves
    allowed = leaves | {"tokenmill", "tokenmill.utils"}
    wrong = {m: sorted(graph[m] - allowed) for m in leaves if graph[m] - allowed}
    assert not wrong, f"configs that import layers, models or other parts: {wrong}"


def test_the_checker_finds_a_cycle_through_a_lazy_import(tmp_path):
    """The two checks above must be able to fail: a package whose knot hides inside a function is caught, and one
    under TYPE_CHECKING is not (it never runs)."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..c import g\n    return g\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
                              "def g():\n    from . import a\n    return a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"} and graph["pkg.d"] == set()
    assert cycles(graph) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
    (pkg / "c.py").write_text("def g():\n    return 1\n")
    assert cycles(import_graph(pkg)) == []


MAX_FUNCTION_LINES = 60


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of each function or method longer than `limit` lines, nested ones included."""
    return [(n.name, n.end_lineno - n.lineno + 1) for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit]


def test_no_function_is_over_60_lines():
    found = {f"{path.relative_to(PACKAGE.parent)}:{name}": lines for path in PACKAGE.rglob("*.py")
             for name, lines in long_functions(path.read_text())}
    assert not found, f"functions over {MAX_FUNCTION_LINES} lines (split them along a seam): {found}"


def test_the_length_check_counts_nested_functions():
    body = "\n".join(f"        x{i} = {i}" for i in range(60))
    source = f"def outer():\n    def inner():\n{body}\n    return inner\n\ndef short():\n    return 1\n"
    assert long_functions(source) == [("outer", 63), ("inner", 61)]
