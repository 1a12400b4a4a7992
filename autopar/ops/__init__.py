"""Sharding strategies per op: the annotation table (rules.py, with view_rules.py and
layer_rules.py; what they read off a node: nodes.py), the annotation language
(annotation.py) and the strategies that follow from an annotation (strategy.py)."""
from autopar.ops.annotation import Annotation
from autopar.ops.nodes import op_arg, op_name, outputs_of, returned_split, tensor_args
from autopar.ops.rules import INTERNAL_COMM, NO_OUTPUT, TRIVIAL, annotate
from autopar.ops.strategy import Strategy, enumerate_strategies, replicated
from autopar.placements import show_placements

__all__ = ["Annotation", "Strategy", "annotate", "op_arg", "enumerate_strategies", "replicated", "op_name",
           "returned_split", "tensor_args", "outputs_of", "show_placements", "TRIVIAL", "NO_OUTPUT", "INTERNAL_COMM"]
