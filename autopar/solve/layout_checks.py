"""The hand-written layouts beside the plan: the user's `layout` checked against the mesh and
model, every relevant layout solved and predicted for the plan's comparison, and one taken
instead of the ILP's choice where it is faster once overlap is counted."""
from __future__ import annotations

import logging

from autopar.mesh import Mesh
from autopar.solve import layouts as B
from autopar.solve.assemble import predict
from autopar.solve.ilp.formulation import InfeasibleError
from autopar.solve.recompute.search import solve_summed
from autopar.solve.ilp.solved import SolveOptions

log = logging.getLogger("autopar")


def check_layout(problem, model, mesh: Mesh, layout) -> dict:
    """Every hand-written layout of `mesh` (name -> rule); raises ValueError for a `layout`
    that is unknown or not possible for this model."""
    every = B.layouts(mesh, every=True)
    if layout in B.GRID_LAYOUTS and layout not in every:
        raise ValueError(f"layout {layout!r} is not possible on mesh {mesh}: {B.grid_misfit(layout, mesh)}")
    if layout is not None and layout not in every:
        raise ValueError(f"unknown layout {layout!r} for mesh {mesh}; choose one of {sorted(every)}")
    if layout is not None and B.unavailable(every[layout], problem):
        raise ValueError(f"layout {layout!r} is not possible for {type(model).__name__} on {mesh}: "
                         f"{B.unavailable(every[layout], problem)}")
    if layout is not None and layout.startswith(("context-parallel", "ulysses")) and not B.relevant(layout, problem):
        log.warning("layout %r splits attention by sequence, but %s has no fused attention op "
                    "(torch.nn.functional.scaled_dot_product_attention) to split: its attention is "
                    "written out in matmuls and softmax, which this layout keeps whole, so it trains as %s. "
                    "Call scaled_dot_product_attention in the model's attention to split it by sequence",
                    layout, type(model).__name__,
                    "Megatron-style tensor parallelism" if "megatron" in layout else
                    "ZeRO-3" if "zero3" in layout else "data parallelism")
    if layout == "expert-parallel" and not any(pn.op == "autopar.experts" for pn in problem.nodes):
        log.warning("layout 'expert-parallel' splits mixture-of-experts ops, but %s has none autopar takes as its "
                    "experts op (stacked experts modules, grouped experts, or a container of expert MLPs with a "
                    "one-hot dispatch mask): experts written out in einsums or batched matmuls stay whole under "
                    "it, so it trains as data parallelism. Leave layout unset: the solver splits such experts "
                    "by their expert dim where that pays", type(model).__name__)
    return every


def compare_layouts(problem, mesh: Mesh, options: SolveOptions, recompute) -> tuple:
    """(name -> Prediction, or why not, of each hand-written layout relevant to the problem;
    name -> its choice, of those solved)."""
    rules = B.layouts(mesh)
    if any(pn.op == "autopar.experts" for pn in problem.nodes):
        rules["expert-parallel"] = B.layouts(mesh, every=True)["expert-parallel"]
    compared, choices = {}, {}
    for name, rule in rules.items():
        if not B.relevant(name, problem):
            continue
        if B.unavailable(rule, problem):
            compared[name] = B.unavailable(rule, problem)
            continue
        try:
            # (summed, not re-solved for overlap: a hand-written layout leaves few choices)
            c = solve_summed(problem, rule, None, options, recompute=recompute).choice
            compared[name] = predict(problem, c)
            choices[name] = c
        except InfeasibleError as exc:
            compared[name] = str(exc)
    return compared, choices


def faster_layout(problem, best, compared: dict, choices: dict, limit):
    """The ILP sums communication; the step it predicts subtracts what gradient buckets
    hide behind backward (assemble.hidden_gradient_seconds), which no linear objective
    sees.  So a hand-written layout compared with the plan can come out faster once
    overlap is counted: then that layout's choice is the plan (within the budget), and the
    log says so."""
    mine = predict(problem, best)
    fits = {n: p for n, p in compared.items() if n in choices and p.memory_total <= limit}
    if not fits:
        return best
    name = min(fits, key=lambda n: fits[n].step_s)
    if fits[name].step_s < mine.step_s * (1 - 1e-9):
        log.info("%s is predicted faster than the ILP's choice once backward's overlap is counted "
                 "(%.4g ms against %.4g ms): planning with it", name, fits[name].step_s * 1e3, mine.step_s * 1e3)
        return choices[name]
    return best
