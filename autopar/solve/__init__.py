"""Stage 5, solving: the planning problem, the ILP, and autopar.plan.

Four wings, each a folder: problem/ (the graph's nodes, shared layers, strategy menus and
prices, held as one frozen Problem), ilp/ (the ILP's folded view, the exact presolve, the
CP-SAT formulation, the solve's records: SolveOptions, Solved, Assignment), recompute/
(recomputation modes per layer, which layers recompute, one assignment fitted under the
budget, offload tiers) and pipeline/ (the stage search: options, stage costs, workers,
candidates, search).  At the top: overlap.py (the overlap-aware second solve), built.py
(Built: a traced, costed problem and its remembered solves), assemble.py (a choice's
collectives, step and memory), layouts.py and layout_checks.py (hand-written layouts),
infeasible.py (the error when no plan fits), forked.py (planning on several cores) and
planner.py (the face: autopar.plan, autopar.random_plans)."""
