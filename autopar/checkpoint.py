"""Sharded checkpoints of a compiled model and its optimizer, with the plan, the step and
the RNG states (runtime/checkpoint.py):

    import autopar.checkpoint
    autopar.checkpoint.save(path, cm, opt, step=step, extra={"epoch": epoch})
    info = autopar.checkpoint.load(path, cm2, opt2)   # any plan, mesh or world size
    step = info["step"]

`latest(directory)` finds the newest complete one, where a restarted job resumes.
"""
from .runtime.checkpoint import CheckpointError, latest, load, save

__all__ = ["save", "load", "latest", "CheckpointError"]
