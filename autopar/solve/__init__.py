"""Stage 5, solving: the planning problem, the ILP, and autopar.plan.

graph.py / layers.py / menus.py / problem.py / reduce.py (the problem: nodes, shared layers,
strategy menus, costs, the folded ILP view), ilp.py (CP-SAT), solved.py (the records:
SolveOptions, Solved, Assignment), fitting.py (one recompute assignment under the budget),
recompute_search.py (which layers recompute), overlap.py (the overlap-aware second solve),
assemble.py (a choice's collectives, step and memory), solution.py (Built: a traced, costed
problem and its remembered solves), recompute.py (recomputation per layer), layouts.py
(hand-written layouts), pipeline_options.py / pipeline_costs.py / pipeline_workers.py /
pipeline_candidates.py / pipeline_search.py (stage cuts), forked.py (planning on several
cores), planner.py (the face: autopar.plan, autopar.random_plans)."""
