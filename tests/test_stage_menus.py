"""A pipeline stage's problem on three or more mesh axes whose menus exceed a planning budget
uses what is left of the axis named "pp" for data parallelism alone
(solve/problem/menus.stage_data_axes, keep_data_parallel, STAGE_MENU_BUDGET): the menus shrink, every op that reads a parameter reads it whole on that axis, the
batch splits there, and the plans of two-axis meshes are untouched."""
from __future__ import annotations

import math

from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.models import build
from autopar.solve.built import build_problem
from autopar.solve.ilp.solved import SolveOptions
from autopar.solve.problem.menus import stage_data_axes


def _problem(shape, axes, pipelined):
    model, example = build("gpt2-124m", device="meta", batch=8)
    mesh = autopar.Mesh(shape, axes, device="h100")
    return build_problem(model, mesh, example, None, pipelined=pipelined)


def _choices(problem) -> int:
    return sum(len(pn.strategies) for pn in problem.problem.nodes if pn.rep == pn.index)


def test_the_axes_a_stage_uses_for_data_alone():
    def mesh(shape, axes):
        return autopar.Mesh(shape, axes, device="h100")
    assert stage_data_axes(mesh((2, 4, 2), ("pp", "dp", "tp"))) == (0,)
    assert stage_data_axes(mesh((4, 2, 2), ("dp", "pp", "tp"))) == (1,)
    assert stage_data_axes(mesh((1, 4, 2), ("pp", "dp", "tp"))) == ()     # nothing left of pp
    assert stage_data_axes(mesh((4, 2), ("pp", "tp"))) == ()              # two axes: the full menus
    assert stage_data_axes(mesh((2, 4, 2), ("a", "dp", "tp"))) == ()      # no axis named pp


def test_stage_menus_on_three_axes_are_data_parallel_on_pp(monkeypatch):
    import autopar.solve.problem.menus as menus
    monkeypatch.setattr(menus, "STAGE_MENU_BUDGET", 0)   # (GPT-2's menus are well within it)
    free = _problem((2, 4, 2), ("pp", "dp", "tp"), pipelined=False)
    stage = _problem((2, 4, 2), ("pp", "dp", "tp"), pipelined=True)
    assert _choices(stage) < 0.5 * _choices(free)
    nodes = stage.problem.nodes
    checked = 0
    for pn in nodes:
        if pn.rep != pn.index or pn.kind != "op" or len(free.problem.nodes[pn.index].strategies) < 2:
            continue
        for s in pn.strategies:
            for (src, _), placement in zip(pn.inputs, s.inputs):
                if nodes[src].kind == "param":
                    assert isinstance(placement[0], Replicate), (pn.name, s.name)
            if pn.requires_grad and pn.from_input:
                p = s.outputs[0][0]
                scalar = math.prod(pn.out_shapes[0]) == 1
                assert (isinstance(p, Shard) and p.dim == 0) or (scalar and isinstance(p, Partial)), (pn.name, s.name)
                checked += 1
    assert checked > 100
    # the restricted plan is a plan of the full menus: never faster, and here as fast
    # (data parallel on the outer axis is what the free plan does too)
    options = SolveOptions()
    assert stage.summed(options).objective >= free.summed(options).objective * (1 - 1e-9)
    assert stage.summed(options).objective <= free.summed(options).objective * 1.05


def test_menus_within_the_budget_and_on_two_axes_are_the_full_ones(monkeypatch):
    stage = _problem((2, 4, 2), ("pp", "dp", "tp"), pipelined=True)
    assert _choices(stage) == _choices(_problem((2, 4, 2), ("pp", "dp", "tp"), pipelined=False))
    import autopar.solve.problem.menus as menus
    monkeypatch.setattr(menus, "STAGE_MENU_BUDGET", 0)
    free = _problem((4, 2), ("pp", "tp"), pipelined=False)
    stage = _problem((4, 2), ("pp", "tp"), pipelined=True)
    assert _choices(stage) == _choices(free)
