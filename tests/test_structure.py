"""The flow stays straight: no import cycles among library files, no private names taken
from other modules, no library imports hidden in functions, no object reading another's
private attributes, every module on the design's module map and no import going up it
(tests/structure.py)."""
from structure import findings


def test_no_cycles_private_imports_deferred_imports_or_reach_ins():
    found = findings()
    assert found == {"cycles": [], "private": [], "deferred": [], "reach_ins": [], "into_solve": [],
                     "unmapped": [], "mapped_without_file": [], "upward": [], "long_files": [],
                     "large_classes": [], "long_functions": [], "face_parameters": []}, found


def test_the_checker_sees_sizes_over_their_budgets(tmp_path, monkeypatch):
    """A file one line over FILE_LINES, a class one method over CLASS_METHODS and a function one
    line over FUNCTION_LINES are each named; one at its budget is not."""
    import structure
    pkg = tmp_path / "autopar"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    body = "".join(f"    x{i} = {i}\n" for i in range(structure.FUNCTION_LINES - 2))
    methods = "".join(f"    def m{i}(self):\n        return {i}\n" for i in range(structure.CLASS_METHODS + 1))
    (pkg / "big.py").write_text(f"def at_budget():\n{body}    return 0\n\n\ndef over():\n{body}    x = 0\n"
                                f"    return x\n\n\nclass Wide:\n{methods}")
    lines = len((pkg / "big.py").read_text().splitlines())
    (pkg / "big.py").write_text((pkg / "big.py").read_text() + "\n" * (structure.FILE_LINES + 1 - lines))
    (pkg / "small.py").write_text("\n" * (structure.FILE_LINES - 1) + "X = 1\n")
    monkeypatch.setattr(structure, "ROOT", tmp_path)
    found = structure.size_findings(structure.module_files())
    assert found == {"long_files": [f"autopar.big: {structure.FILE_LINES + 1} lines (budget 500)"],
                     "large_classes": [f"autopar.big.Wide: {structure.CLASS_METHODS + 1} methods (budget 25)"],
                     "long_functions": [f"autopar.big.over: {structure.FUNCTION_LINES + 1} lines (budget 80)"]}


def test_the_checker_sees_faces_over_their_parameter_budget(tmp_path, monkeypatch):
    """A face with FACE_PARAMETERS + 1 parameters, and one that hides options behind
    **kwargs, are each named; one at its budget is not."""
    import structure
    pkg = tmp_path / "autopar"
    pkg.mkdir()
    at = ", ".join(f"a{i}" for i in range(structure.FACE_PARAMETERS))
    (pkg / "__init__.py").write_text("from autopar.faces import plan, compile, other\n")
    (pkg / "faces.py").write_text(f"def plan({at}, *, extra=None):\n    pass\n\n\n"
                                  f"def compile(model, **kwargs):\n    pass\n\n\ndef other({at}):\n    pass\n")
    monkeypatch.setattr(structure, "ROOT", tmp_path)
    assert structure.face_findings(structure.module_files()) == [
        "autopar.compile: 1 parameters and **kwargs (budget 10, no **kwargs)",
        "autopar.plan: 11 parameters (budget 10, no **kwargs)"]


def test_the_checker_sees_the_runtime_reach_into_the_solver():
    """Passes and runtime call the solver only through its face (autopar.solve.planner)."""
    import structure
    edges = [("autopar.runtime.x", "autopar.solve.problem.graph"), ("autopar.runtime.x", "autopar.solve.planner"),
             ("autopar.passes.y", "autopar.ops.rules"), ("autopar.solve.a", "autopar.solve.b")]
    assert structure.into_solve(edges) == ["autopar.runtime.x imports autopar.solve.problem.graph"]


def test_the_checker_sees_a_cycle(tmp_path, monkeypatch):
    """The checker is not blind: two modules importing each other are one cycle."""
    import structure
    pkg = tmp_path / "autopar"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .b import f\n")
    (pkg / "b.py").write_text("def f():\n    from .a import _g\n\n\nclass Owner:\n    def __init__(self):\n"
                              "        self._parts = []\n\n\ndef peek(owner):\n    return owner._parts\n")
    monkeypatch.setattr(structure, "ROOT", tmp_path)
    (pkg / "c.py").write_text("X = 1\n")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "DESIGN.md").write_text("```modules\n[first]\nautopar/b.py   b\n[second]\n"
                                                  "autopar/a.py   a\nautopar/gone.py   not there\n```\n")
    found = structure.findings()
    assert found["cycles"] == [["autopar.a", "autopar.b"]]
    assert found["private"] == ["autopar.b imports _g from autopar.a"]
    assert found["deferred"] == ["autopar.b imports autopar.a inside a function"]
    assert found["reach_ins"] == ["autopar.b:11 reads owner._parts"]
    assert found["unmapped"] == ["autopar.c"] and found["mapped_without_file"] == ["autopar.gone"]
    assert found["upward"] == ["autopar.b (first) imports autopar.a (second)"]
