"""How straight the flow is: import cycles, private names imported across modules, and
library imports hidden inside functions, among autopar's own files.

    python tests/structure.py          # prints the counts and each finding; exit 1 if any

Library files are autopar/, passes/, runtime/ and models/ (installed as autopar,
autopar.passes, autopar.runtime, autopar.models).  An import cycle is a set of modules that
import each other, directly or through others (a strongly connected component of the
module graph; a package's __init__ re-exporting its own modules does not count).  A
private name is one starting with "_" (not a dunder) taken from another module by
`from x import _name`.  A deferred import is a library import inside a function body;
the only one allowed is `autopar.compile` reaching the runtime, the last stage, on use.
A reach-in is `obj._name` where `_name` is a private attribute or method that library code
defines on `self` (`self._name = ...`, `def _name`) and `obj` is not `self` or `cls`: one
object using another's privates instead of its public parts.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"autopar": "autopar"}
ALLOWED_DEFERRED = {("autopar", "autopar.runtime.compiled")}


def module_files() -> dict:
    """module name -> path of every library file."""
    out = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            out[".".join([package, *parts])] = path
    return out


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def imports_of(module: str, path: Path, known: set) -> list:
    """(imported module, names taken, inside a function) for every import of a library module."""
    tree = ast.parse(path.read_text(), str(path))
    is_package = path.name == "__init__.py"
    found = []

    def visit(node, in_function):
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name.split(".")[0] == "autopar":
                        found.append((alias.name, (), in_function))
            elif isinstance(child, ast.ImportFrom):
                target = _resolve(module, is_package, child.level, child.module)
                if target.split(".")[0] != "autopar":
                    continue
                names = tuple(a.name for a in child.names)
                modules = [f"{target}.{n}" for n in names if f"{target}.{n}" in known]
                for m in modules:  # `from . import x` imports module x
                    found.append((m, (), in_function))
                rest = tuple(n for n in names if f"{target}.{n}" not in known)
                if rest or not modules:
                    found.append((target, rest, in_function))
            visit(child, nested)

    visit(tree, False)
    return found


def private_members(trees: dict) -> set:
    """Private names library classes define on themselves: `self._x = ...` and `def _x`."""
    out = set()
    for tree in trees.values():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(item.name):
                        out.add(item.name)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, (ast.AnnAssign, ast.AugAssign)) else []
            for t in targets:
                if (isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
                        and _private(t.attr)):
                    out.add(t.attr)
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def reach_ins(files: dict) -> list:
    trees = {module: ast.parse(path.read_text(), str(path)) for module, path in files.items()}
    members = private_members(trees)
    out = []
    for module, tree in trees.items():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and node.attr in members
                    and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
                out.append(f"{module}:{node.lineno} reads {ast.unparse(node)}")
    return out


def findings() -> dict:
    files = module_files()
    known = set(files)
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    private, deferred = [], []
    for module, path in files.items():
        for target, names, in_function in imports_of(module, path, known):
            while target and target not in known:  # a name inside a module: the module
                target = target.rpartition(".")[0]
            if not target or target == module:
                continue
            reexport = path.name == "__init__.py" and target.startswith(module + ".")
            if not reexport and not module.startswith(target + "."):  # a module importing its package
                graph.add_edge(module, target)
            for n in names:
                if n.startswith("_") and not n.startswith("__"):
                    private.append(f"{module} imports {n} from {target}")
            if target.split(".")[-1].startswith("_") and not target.endswith("__init__"):
                private.append(f"{module} imports private module {target}")
            if in_function and (module, target) not in ALLOWED_DEFERRED:
                deferred.append(f"{module} imports {target} inside a function")
    cycles = [sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1]
    return {"cycles": cycles, "private": private, "deferred": deferred, "reach_ins": reach_ins(files)}


def main() -> int:
    found = findings()
    for kind, items in found.items():
        print(f"{kind}: {len(items)}")
        for item in items:
            print(f"  {item}")
    return 1 if any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
