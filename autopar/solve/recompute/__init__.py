"""Memory under the budget: recomputation modes per layer (modes.py), the fastest plan under
one recompute assignment (fitting.py), which layers recompute (search.py), and offloaded
states kept within each memory tier (tiers.py)."""
