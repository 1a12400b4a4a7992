"""Worker jobs of tests/test_grid_tp.py: the bytes a compiled step's collectives move, counted
at the collective calls themselves."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

import autopar
from autopar.passes import grid_ops as G
from autopar.passes import redistribute as R
from autopar.report.plan import Plan


class Block(nn.Module):
    """One transformer MLP block with a squared-output loss: x [B, S, h] -> fc1 -> gelu -> fc2."""

    def __init__(self, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(x))).pow(2).mean()


def block_case(hidden: int, batch: int, seq: int):
    torch.manual_seed(0)
    model = Block(hidden)
    x = torch.randn(batch, seq, hidden, generator=torch.Generator().manual_seed(1))
    return model, x


def block_plan(hidden: int, batch: int, seq: int, shape: tuple, layout: str) -> dict:
    model, x = block_case(hidden, batch, seq)
    mesh = autopar.Mesh(shape, tuple("abc"[:len(shape)]), device="cpu")
    return autopar.plan(model, mesh, (x,), solve=autopar.SolveOptions(compare=False, layout=layout)).to_dict()


@contextlib.contextmanager
def counted(tally: dict, flag: dict):
    """Count the bytes this rank receives per collective kind (all-gather: the n - 1 pieces of
    the others; reduce-scatter: (n - 1)/n of its input; all-reduce: a ring's 2 (n - 1)/n of
    it), under tally["grid"] for calls made inside a grid linear layer and tally["other"] for
    the rest.  gloo runs a reduce-scatter as an all-reduce: that one is counted as the
    reduce-scatter it stands for.  Scalars (a loss's sum) are left out."""
    gather, reduce, rows = dist.all_gather, dist.all_reduce, R.reduce_scatter_rows
    state = {"rs": False}

    def add(kind, nbytes):
        where = tally.setdefault("grid" if flag["on"] else "other", {})
        where[kind] = where.get(kind, 0) + nbytes

    def all_gather(parts, t, group=None, async_op=False):
        if t.numel() > 1:
            add("all_gather", t.numel() * t.element_size() * (len(parts) - 1))
        return gather(parts, t, group=group, async_op=async_op)

    def all_reduce(t, op=dist.ReduceOp.SUM, group=None, async_op=False):
        n = dist.get_world_size(group)
        if t.numel() > 1 and not state["rs"]:
            add("all_reduce", 2 * (n - 1) * t.numel() * t.element_size() // n)
        return reduce(t, op=op, group=group, async_op=async_op)

    def reduce_scatter_rows(table, group, index, native=None, async_op=False):
        n = dist.get_world_size(group)
        add("reduce_scatter", (n - 1) * table.numel() * table.element_size() // n)
        state["rs"] = True
        try:
            return rows(table, group, index, native, async_op)
        finally:
            state["rs"] = False

    dist.all_gather, dist.all_reduce, R.reduce_scatter_rows = all_gather, all_reduce, reduce_scatter_rows
    try:
        yield tally
    finally:
        dist.all_gather, dist.all_reduce, R.reduce_scatter_rows = gather, reduce, rows


def grid_bytes(hidden: int, batch: int, seq: int, plan_dict: dict) -> dict:
    """{"forward": tally, "step": tally} of one forward and of one training step of the block
    under the plan (tally as `counted` fills it)."""
    plan = Plan.from_dict(plan_dict)
    model, x = block_case(hidden, batch, seq)
    original = G._GridLinear.forward, G._GridLinear.backward
    flag = {"on": False}
    out = {}

    def flagged(fn):
        def run(ctx, *args):
            flag["on"] = True
            try:
                return fn(ctx, *args)
            finally:
                flag["on"] = False
        return staticmethod(run)

    G._GridLinear.forward, G._GridLinear.backward = flagged(original[0]), flagged(original[1])
    try:
        cm = autopar.compile(model, plan.device_mesh(), (x,), plan=plan)
        cm.train_step(x)            # (the first step settles what runs once)
        cm.zero_grad()
        for key, run in (("forward", lambda: cm(x)), ("step", lambda: cm.train_step(x))):
            tally: dict = {}
            with counted(tally, flag):
                if key == "forward":
                    with torch.no_grad():
                        run()
                else:
                    run()
            out[key] = tally
    finally:
        G._GridLinear.forward, G._GridLinear.backward = staticmethod(original[0]), staticmethod(original[1])
    return out
