"""One solve: the ILP's view of a Problem (reduce.py), the exact presolve (presolve.py), the
CP-SAT formulation (formulation.py) and the records a solve is asked with and returns
(solved.py)."""
