"""The batch dimension of a model's example inputs: its size, and the first microbatch.

The planner, the pipeline search and the pipelined runtime all cut the global batch (dim 0
of every input) into microbatches; they agree on it through these two functions.
"""
from __future__ import annotations

import torch
from torch.utils import _pytree as pytree


def batch_size(example_inputs, example_kwargs=None) -> int:
    """The batch: dim 0 of every tensor input, which must agree."""
    sizes = {t.shape[0] for t in pytree.tree_leaves((tuple(example_inputs), example_kwargs or {}))
             if isinstance(t, torch.Tensor) and t.dim() > 0}
    if len(sizes) != 1:
        raise ValueError(f"pipeline search splits the batch (dim 0 of every input) into microbatches; the "
                         f"inputs' first dims {sorted(sizes)} differ")
    return sizes.pop()


def first_microbatch(tree, batch: int, size: int):
    """`tree` (inputs) with every tensor of `batch` rows cut to its first `size` rows: real
    rows for a real model, shapes for a meta one."""
    def cut(t):
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch:
            return t[:size]
        return t
    return pytree.tree_map(cut, tree)
