"""Stage 5, solving: the planning problem, the ILP, and autopar.plan.

graph.py / layers.py / menus.py (the graph's nodes, shared layers and strategy menus),
pricing.py / fusion.py / saved_memory.py / node_prices.py / gradient_paths.py / edge_prices.py /
edge_steps.py (the pieces of the problem's prices), problem.py (Problem, their frozen holder),
reduce.py (the folded ILP view), ilp.py (CP-SAT), solved.py (the records:
SolveOptions, Solved, Assignment), fitting.py (one recompute assignment under the budget),
recompute_search.py (which layers recompute), overlap.py (the overlap-aware second solve),
assemble.py (a choice's collectives, step and memory), solution.py (Built: a traced, costed
problem and its remembered solves), recompute.py (recomputation per layer), layouts.py
(hand-written layouts), pipeline_options.py / pipeline_costs.py / pipeline_workers.py /
pipeline_candidates.py / pipeline_search.py (stage cuts), forked.py (planning on several
cores), planner.py (the face: autopar.plan, autopar.random_plans)."""
