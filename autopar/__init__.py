"""autopar: plan and run the parallel training of a PyTorch model on a device mesh."""
import logging as _logging

from autopar.mesh import DeviceSpec, Mesh
from autopar.report.plan import Plan
from autopar.solve.pipeline.options import Pipeline
from autopar.cost.precision import MixedPrecision
from autopar.solve.ilp.formulation import InfeasibleError
from autopar.trace.export import TraceError
from autopar.solve.planner import plan, random_plans

_logging.getLogger("autopar").addHandler(_logging.NullHandler())

__all__ = ["Mesh", "DeviceSpec", "MixedPrecision", "Pipeline", "Plan", "plan", "random_plans", "compile",
           "InfeasibleError", "TraceError"]


def compile(model, mesh, example_inputs=(), **kwargs):
    """Compile `model` for `mesh` under torchrun: see autopar.runtime.compiled.compile."""
    from autopar.runtime.compiled import compile as _compile  # the runtime is the last stage: import on use
    return _compile(model, mesh, example_inputs, **kwargs)
__version__ = "0.1.0"
