"""Sharded checkpoints of a compiled model and its optimizer, with the plan, the step and
the RNG states (autopar/runtime/state/checkpoint.py):

    import autopar.checkpoint
    autopar.checkpoint.save(path, cm, opt, step=step, extra={"epoch": epoch})
    info = autopar.checkpoint.load(path, cm2, opt2)   # any plan, mesh or world size
    step = info["step"]

`latest(directory)` finds the newest complete one, where a restarted job resumes.

The model is saved under the plain model's names, so the plain model reads it too, with
or without a process group:

    torch.distributed.checkpoint.load({"model": model.state_dict()}, checkpoint_id=path)
    model.load_state_dict(autopar.checkpoint.to_state_dict(path))   # one process, whole tensors
    autopar.checkpoint.export(path, "model.safetensors")            # or "model.pt" (torch.save)
"""
from autopar.runtime.state.checkpoint import CheckpointError, export, latest, load, save, to_state_dict

__all__ = ["save", "load", "latest", "to_state_dict", "export", "CheckpointError"]
