"""The error for a memory budget no plan fits: the least memory a plan needs, what it is made
of, and what would make the model fit."""
from __future__ import annotations

import math

from autopar.solve.assemble import predict
from autopar.solve.ilp.formulation import InfeasibleError
from autopar.solve.overlap import solve_problem
from autopar.solve.recompute.modes import layer_slots
from autopar.solve.ilp.solved import SolveOptions


def infeasible_error(problem, model, mesh, limit, options: SolveOptions, recompute=None) -> InfeasibleError:
    """The error for a budget no plan fits: the memory of the least-memory plan found (the
    minimum of the ILP's linear memory sum, plus that plan's working memory: an upper bound
    on the true least, which the message says), what it is made of, and what would make the
    model fit (recomputation among it, with what it saves)."""
    layered = bool(layer_slots(problem))
    keep = solve_problem(problem, None, None, options, minimise_memory=True, recompute="none")
    kept_floor = keep.memory
    least = recompute if recompute in ("selective", "alternate", "full", "offload") else (
        "offload" if layered and recompute is None else "none")   # (offload keeps the fewest activations)
    least_plan = solve_problem(problem, None, None, options, minimise_memory=True, recompute=least) \
        if least != "none" else keep
    choice, floor = least_plan.choice, least_plan.memory
    memory = predict(problem, choice).memory
    gib = 2**30
    parts = ", ".join(f"{k} {v / gib:.2f}" for k, v in memory.items())
    states = floor - memory["activations"] - memory["working"]
    devices = math.ceil(mesh.size * floor / limit)
    picked = [problem.nodes[pn.rep].strategies[choice[pn.index]] for pn in problem.nodes if pn.kind == "param"]
    offloaded = sum(1 for s in picked if s.offload)
    with_weights = sum(1 for s in picked if s.offload_weights)
    hints = [f"about {devices} devices instead of {mesh.size} (more data- or tensor-parallel ranks: "
             f"states and activations both shrink with the device count)"]
    if memory["activations"] > 0.2 * floor:
        hints.append(f"fewer activations: activations are {memory['activations'] / floor:.0%} of that minimum, "
                     f"so a smaller batch per step (gradient accumulation keeps the global batch)")
    if layered and least == "none":
        try:
            full = solve_problem(problem, None, None, options, minimise_memory=True, recompute="full").memory
            hints.append(f"recomputing activations in backward: recompute='full' (or None, to let the planner "
                         f"choose per layer) saves {(kept_floor - full) / gib:.2f} GiB per device, for a least of "
                         f"{full / gib:.2f} GiB")
        except InfeasibleError:
            pass
    with_recompute = ""
    if least != "none":
        with_recompute = (f" and every repeated layer's activations offloaded to host memory (which saves "
                          f"{(kept_floor - floor) / gib:.2f} GiB against keeping every activation)"
                          if least == "offload" else
                          f" and every repeated layer recomputed in full (which saves {(kept_floor - floor) / gib:.2f} "
                          f"GiB against keeping every activation)" if least == "full" else
                          f" and every repeated layer recomputed selectively (saving {(kept_floor - floor) / gib:.2f} "
                          f"GiB; recompute='full' or None saves more)")
    if states > 0.2 * floor:
        how = "offloaded to host memory" if offloaded else "sharded"
        hints.append(f"smaller model states: weights, gradients and optimizer states are {states / floor:.0%} of "
                     f"it even {how}; mixed precision (autopar.MixedPrecision) halves weights and gradients")
    return InfeasibleError(
        f"no plan of {type(model).__name__} on {mesh} fits {limit / gib:.2f} GiB per device; the least-memory "
        f"plan found needs {floor / gib:.2f} GiB per device (GiB: {parts}; the search minimises the ILP's "
        f"memory sum, so a plan a little smaller may exist), with every parameter sharded "
        f"(ZeRO-3 or tensor parallel), {offloaded} parameters' optimizer states offloaded to the host"
        f"{f' ({with_weights} with their weights)' if with_weights else ''}"
        f"{with_recompute}. To fit: " + "; or ".join(hints) + f"; or raise memory_budget to "
        f"{floor / gib:.2f} GiB (that plan fits it).")
