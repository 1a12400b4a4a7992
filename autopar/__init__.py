"""autopar: plan and run the parallel training of a PyTorch model on a device mesh."""
import logging as _logging

from .mesh import DeviceSpec, Mesh
from .plan import Plan
from .pipeline.search import Pipeline
from .precision import MixedPrecision
from .planner import plan
from .solver import InfeasibleError
from .trace import TraceError

_logging.getLogger("autopar").addHandler(_logging.NullHandler())

__all__ = ["Mesh", "DeviceSpec", "MixedPrecision", "Pipeline", "Plan", "plan", "compile", "InfeasibleError", "TraceError"]


def compile(model, mesh, example_inputs=(), **kwargs):
    """Compile `model` for `mesh` under torchrun: see autopar.runtime.compiled.compile."""
    from .runtime.compiled import compile as _compile  # the runtime is the last stage: import on use
    return _compile(model, mesh, example_inputs, **kwargs)
__version__ = "0.1.0"
