"""Stage 5, solving: the planning problem, the ILP, and autopar.plan.

graph.py / layers.py / menus.py / problem.py / reduce.py (the problem: nodes, shared layers,
strategy menus, costs, the folded ILP view), ilp.py (CP-SAT), solution.py (solve and assemble
a Plan), recompute.py (recomputation per layer), layouts.py (hand-written layouts),
pipeline_search.py (stage cuts), forked.py (planning on several cores), planner.py (the face)."""
