"""The pipeline stage search: what it ranges over (options.py), stage costs (costs.py), who
costs which candidate (workers.py), one candidate simulated (candidates.py), the search
(search.py)."""
