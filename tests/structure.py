"""How straight the flow is: import cycles, private names imported across modules, library
imports hidden inside functions, modules missing from the design's module map, and imports
that go up the map, among autopar's own files.

    python tests/structure.py            # prints the counts and each finding; exit 1 if any
    python tests/structure.py --metrics  # each size against its budget, module-level state

Library files are everything under autopar/.  The module map is the fenced block headed
`modules` in docs/DESIGN.md: stage headings (`[trace]`) in flow order, each followed by its
modules (`autopar/trace/export.py   what it does`).  A module may import from its own stage
and the stages above it; importing from a stage below is an upward import.  An import cycle is a set of modules that
import each other, directly or through others (a strongly connected component of the
module graph; a package's __init__ re-exporting its own modules does not count).  A
private name is one starting with "_" (not a dunder) taken from another module by
`from x import _name`.  A deferred import is a library import inside a function body;
the only one allowed is `autopar.compile` reaching the runtime, the last stage, on use.
A reach-in is `obj._name` where `_name` is a private attribute or method that library code
defines on `self` (`self._name = ...`, `def _name`) and `obj` is not `self` or `cls`: one
object using another's privates instead of its public parts.

The faces (autopar.plan, autopar.compile, found where autopar/__init__.py imports them)
take at most FACE_PARAMETERS parameters each and no **kwargs: a face that grows takes a
record (Pricing, SolveOptions, RunOptions), so an editor shows every option.

Size budgets hold a newcomer's reading: no library file over FILE_LINES lines, no class with
more than CLASS_METHODS methods of its own, no function (or method) over FUNCTION_LINES lines
(its docstring included).  Each one over is a finding, like an import that goes the wrong way.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import networkx as nx

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"autopar": "autopar"}
ALLOWED_DEFERRED: set = set()
FILE_LINES, CLASS_METHODS, FUNCTION_LINES = 500, 25, 80
# the faces' parameter budget: what a user passes is a few records, not twenty keywords
FACES, FACE_PARAMETERS = ("plan", "compile"), 10


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
    return {"cycles": cycles, "private": private, "deferred": deferred, "reach_ins": reach_ins(files),
            "into_solve": into_solve(graph.edges), **map_findings(files, graph.edges), **size_findings(files),
            "face_parameters": face_findings(files)}


def face_parameters(files: dict) -> dict:
    """face name -> (its parameters, whether it takes **kwargs), read from the def of each
    FACES name in the module autopar/__init__.py imports it from."""
    out = {}
    for node in ast.parse(files["autopar"].read_text()).body:
        if not isinstance(node, ast.ImportFrom) or node.module not in files:
            continue
        for alias in node.names:
            if alias.name in FACES:
                tree = ast.parse(files[node.module].read_text())
                fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == alias.name)
                a = fn.args
                named = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs] + ([a.vararg.arg] if a.vararg else [])
                out[f"autopar.{alias.asname or alias.name}"] = (named, a.kwarg is not None)
    return out


def face_findings(files: dict) -> list:
    """Faces over FACE_PARAMETERS parameters, or taking **kwargs (which no editor can show)."""
    return sorted(f"{face}: {len(named)} parameters{' and **kwargs' if kwargs else ''} (budget {FACE_PARAMETERS}, "
                  f"no **kwargs)" for face, (named, kwargs) in face_parameters(files).items()
                  if len(named) > FACE_PARAMETERS or kwargs)


def sizes(files: dict) -> tuple:
    """(lines per module, (methods, module.Class) per class, (lines, module.function) per
    function or method), the sizes the budgets hold."""
    lines, classes, functions = {}, [], []
    for module, path in files.items():
        text = path.read_text()
        lines[module] = len(text.splitlines())
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.ClassDef):
                methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
                classes.append((len(methods), f"{module}.{node.name}"))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                functions.append((node.end_lineno - node.lineno + 1, f"{module}.{node.name}"))
    return lines, classes, functions


def size_findings(files: dict) -> dict:
    """Files, classes and functions over their budgets (FILE_LINES, CLASS_METHODS, FUNCTION_LINES)."""
    lines, classes, functions = sizes(files)
    return {"long_files": sorted(f"{m}: {n} lines (budget {FILE_LINES})" for m, n in lines.items() if n > FILE_LINES),
            "large_classes": sorted(f"{c}: {n} methods (budget {CLASS_METHODS})" for n, c in classes
                                    if n > CLASS_METHODS),
            "long_functions": sorted(f"{f}: {n} lines (budget {FUNCTION_LINES})" for n, f in functions
                                     if n > FUNCTION_LINES)}


PLANNING_FACE = "autopar.solve.planner"


def into_solve(edges) -> list:
    """Imports of the solver's insides by the passes or the runtime: they read a Plan and
    the facts below the solver (ops, cost, plan, placements), and call the solver only
    through its face (autopar.solve.planner: plan())."""
    return sorted(f"{a} imports {b}" for a, b in edges
                  if a.startswith(("autopar.passes", "autopar.runtime")) and b.startswith("autopar.solve")
                  and b != PLANNING_FACE)


MAP_FILE = "docs/DESIGN.md"


def module_map(text: str) -> dict:
    """module name -> (stage index, stage name), read from the `modules` block of the design page."""
    block = text.split("```modules\n", 1)
    if len(block) < 2:
        return {}
    stages, out = [], {}
    for line in block[1].split("```", 1)[0].splitlines():
        line = line.strip()
        if line.startswith("[") and "]" in line:
            stages.append(line[1:line.index("]")])
        elif line.startswith("autopar/") and stages:
            path = Path(line.split()[0])
            parts = [p for p in path.with_suffix("").parts if p != "__init__"]
            out[".".join(parts)] = (len(stages) - 1, stages[-1])
    return out


def map_findings(files: dict, edges) -> dict:
    """Modules the map misses or names without a file, and imports that go up the map."""
    listed = module_map((ROOT / MAP_FILE).read_text()) if (ROOT / MAP_FILE).exists() else {}
    missing = sorted(m for m, p in files.items() if m not in listed and not _only_docstring(p))
    stale = sorted(m for m in listed if m not in files)
    upward = sorted(f"{a} ({listed[a][1]}) imports {b} ({listed[b][1]})" for a, b in edges
                    if a in listed and b in listed and listed[b][0] > listed[a][0])
    return {"unmapped": missing, "mapped_without_file": stale, "upward": upward}


def _only_docstring(path: Path) -> bool:
    """A package's __init__ that only describes its folder: the map names the folder's modules."""
    body = ast.parse(path.read_text()).body
    return all(isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant) for n in body)


def metrics() -> dict:
    """The sizes a newcomer meets: largest file, class (methods) and function, and the
    module-level mutable state (a module-level dict, list or set that code mutates later, or
    an instance of a class of the same module)."""
    files = module_files()
    lines, classes, functions = sizes(files)
    state = []
    mutators = {"append", "extend", "add", "update", "setdefault", "pop", "popitem", "clear", "insert",
                "remove", "discard"}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        mutable = set()
        for node in tree.body:
            value = getattr(node, "value", None)
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
                node, ast.AnnAssign) else []
            if value is not None and (isinstance(value, (ast.Dict, ast.List, ast.Set)) or (
                    isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
                    and value.func.id in ("dict", "list", "set", "defaultdict", "OrderedDict"))):
                mutable |= {t.id for t in targets if isinstance(t, ast.Name)}
        classes_here = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
        for node in tree.body:   # a module-level instance of a class of its own holds state too (a cache)
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(
                    node.value.func, ast.Name) and node.value.func.id in classes_here:
                state += [f"{module}.{t.id}" for t in node.targets if isinstance(t, ast.Name)]
        touched = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in mutators \
                    and isinstance(node.func.value, ast.Name):
                touched.add(node.func.value.id)
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete)):
                for t in (node.targets if isinstance(node, (ast.Assign, ast.Delete)) else [node.target]):
                    if isinstance(t, ast.Subscript) and isinstance(t.value, ast.Name):
                        touched.add(t.value.id)
            elif isinstance(node, ast.Global):
                touched |= set(node.names)
        state += [f"{module}.{name}" for name in sorted(mutable & touched)]
    readme = (ROOT / "README.md").read_text().split()
    biggest = max(lines, key=lines.get)
    return {"largest file": f"{biggest}: {lines[biggest]} lines (budget {FILE_LINES})",
            "largest class": "{1}: {0} methods (budget {2})".format(*max(classes), CLASS_METHODS),
            "longest function": "{1}: {0} lines (budget {2})".format(*max(functions), FUNCTION_LINES),
            "module-level mutable state": f"{len(state)}: {', '.join(state)}",
            **{f"{face} parameters": f"{len(named)}{' and **kwargs' if kwargs else ''} (budget {FACE_PARAMETERS})"
               for face, (named, kwargs) in face_parameters(files).items()},
            "README words": str(len(readme)), "library files": str(len(files)),
            "library lines": str(sum(len(p.read_text().splitlines()) for p in files.values()))}


def main() -> int:
    if "--metrics" in sys.argv:
        for name, value in metrics().items():
            print(f"{name}: {value}")
        return 0
    found = findings()
    for kind, items in found.items():
        print(f"{kind}: {len(items)}")
        for item in items:
            print(f"  {item}")
    return 1 if any(found.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
