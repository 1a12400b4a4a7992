"""`autopar calibrate`: the machine measured and the cost model fitted (fit.py), from timed
runs (timing.py) of compute (compute.py), links (links.py) and whole steps (step.py)."""
