"""The planning problem: every node of the traced graph with its strategy menu and prices,
every edge with its resharding prices, identical layers sharing one set of choices, all
held by one frozen Problem (problem.py)."""
