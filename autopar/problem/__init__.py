"""The planning problem (see core.py): the graph walk and gradient sums (graph.py), layer
sharing (layers.py), strategy menus (menus.py), the Problem with its costs (core.py) and
its folded ILP view (reduce.py)."""
from .core import UNUSABLE, Problem
from .graph import SAVES_NOTHING, VIEWS, Choice, EdgeKey, PNode, block_of, module_path
from .layers import SHARE_PERIOD
from .menus import same_local_shape, zero_layout
from .reduce import Reduced, reduce_problem

__all__ = ["Problem", "Reduced", "reduce_problem", "PNode", "EdgeKey", "Choice", "module_path", "block_of",
           "VIEWS", "SAVES_NOTHING", "SHARE_PERIOD", "UNUSABLE", "same_local_shape", "zero_layout"]
