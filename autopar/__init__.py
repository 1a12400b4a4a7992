"""autopar: plan and run the parallel training of a PyTorch model on a device mesh."""
import logging as _logging

from autopar.mesh import DeviceSpec, Mesh
from autopar.report.plan import Plan
from autopar.solve.pipeline.options import Pipeline
from autopar.solve.problem.pricing import Pricing
from autopar.solve.ilp.solved import SolveOptions
from autopar.runtime.options import RunOptions
from autopar.cost.precision import MixedPrecision
from autopar.solve.ilp.formulation import InfeasibleError
from autopar.trace.export import TraceError
from autopar.deprecations import AutoparDeprecationWarning
from autopar.runtime.compiled import compile
from autopar.solve.planner import plan, random_plans

_logging.getLogger("autopar").addHandler(_logging.NullHandler())

__all__ = ["Mesh", "DeviceSpec", "MixedPrecision", "Pipeline", "Pricing", "SolveOptions", "RunOptions", "Plan",
           "plan", "random_plans", "compile", "InfeasibleError", "TraceError", "AutoparDeprecationWarning"]


__version__ = "0.1.0"
