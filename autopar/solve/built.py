"""A traced and costed problem (Built) and its solves: build_problem traces the model and
costs its strategy menus; a Built remembers the solves with no budget that both the
pipeline search and the planner ask for (the summed optimum, the hand-written layouts'), so
none is solved twice.

Solving itself is in three modules, each calling the one before: recompute/fitting.py (one
recompute assignment under the budget), recompute/search.py (which layers recompute: the
summed optimum), overlap.py (the overlap-aware second solve: solve_problem); assemble.py
turns a choice into the plan's facts.
"""
from __future__ import annotations

import logging
import time

from autopar.cost.precision import cast_for_trace, meta_inputs
from autopar.solve.problem.problem import Problem
from autopar.solve.recompute.search import solve_summed
from autopar.solve.ilp.solved import SolveOptions, Solved
from autopar.trace.cache import TRACES
from autopar.trace.export import trace
from autopar.trace.shortened import shortened
from autopar.trace.loss import check_loss_output

log = logging.getLogger("autopar")


class Built:
    """A traced and costed problem (a candidate the planner or the pipeline search solves),
    with how long each took.  It remembers its summed optimum with no layout rule and no
    budget (what the pipeline search prices a stage by) and its hand-written layouts'
    (likewise), each solved once, when first asked for."""

    def __init__(self, problem: Problem, trace_s: float, costs_s: float):
        self.problem = problem
        self.trace_s = trace_s
        self.costs_s = costs_s
        self._summed: Solved | None = None
        self._laid_out: dict = {}   # hand-written layout name -> its summed optimum (laid_out)

    @property
    def short(self) -> bool:
        """Whether its trace is shortened (build_problem(short=True)): its solves' choices
        give each layer's costs; their totals and memory are not the model's."""
        return bool(self.problem.traced.weights)

    def __repr__(self) -> str:
        return (f"Built({len(self.problem.nodes)} nodes on {self.problem.mesh}, traced in {self.trace_s:.2f}s, "
                f"costed in {self.costs_s:.2f}s)")

    def summed(self, options: SolveOptions) -> Solved:
        """solve_summed with no layout rule and no budget: the plan whose summed seconds are
        least (what a pipeline stage's costs add up), without the overlap-aware second solve."""
        if self._summed is None:
            self._summed = solve_summed(self.problem, None, None, options)
        return self._summed

    def laid_out(self, name: str, rule, options: SolveOptions) -> Solved:
        """solve_summed under the hand-written layout `name` (its `rule`), no budget: a
        pipeline stage priced as an expert lays it out (pipeline/costs.layer_costs)."""
        if name not in self._laid_out:
            self._laid_out[name] = solve_summed(self.problem, rule, None, options)
        return self._laid_out[name]

    def known(self, staged: bool, layout: str | None = None) -> Solved | None:
        """A plan solved already that is the planner's answer with no layout rule and no
        forced recomputation, or None: staged (one microbatch of a pipeline whose stages'
        memory the search checked), the summed plan the search priced the stages by (under
        the hand-written `layout` it priced them in, when it did).  The plan without stages
        is solved when the planner asks for it (the search no longer solves its
        overlap-aware optimum ahead: on the 405B-shaped Llama and DeepSeek-V3 that took 6
        and 12 s of the search's busiest process for a plan never used)."""
        if staged and layout is not None:
            return self._laid_out.get(layout)
        if staged and self._summed is not None:
            return self._summed
        return None

    def free(self) -> Solved | None:
        """The summed optimum with no budget, when solved already (the budgeted search's
        first solve: solve_summed's `free`)."""
        return self._summed

    def first_step(self, limit: float) -> Solved | None:
        """The summed optimum with no budget when solved already and within `limit`: the
        budgeted solve's first step (solve_problem's `summed`)."""
        return self._summed if self._summed is not None and self._summed.memory <= limit else None


def build_problem(model, mesh, args, kwargs, mixed_precision=None, grouped_gathers=True, pricing=None,
                  pipelined=False, short=False) -> Built:
    """Trace `model` on (args, kwargs) and build its strategy menus and costs on `mesh`
    (grouped_gathers, pricing, pipelined: see Problem).
    Under mixed precision what runs is traced: the model cast to param_dtype on meta inputs.
    Repeated layers are traced three of them and written out (autopar/trace/unroll.py): the same
    graph the runtime traces, checked by its signature when the plan is compiled.
    short: the trace cut to four or five of its alike layers where it has them
    (autopar/trace/shortened.py), for a problem whose summed optimum is asked only for its
    per-layer costs (Built.short; no plan is made of it)."""
    start = time.perf_counter()
    traced = planning_trace(model, args, kwargs, mixed_precision)
    check_loss_output(model, traced)
    if short:
        traced = shortened(traced) or traced
    t_trace = time.perf_counter() - start
    problem = Problem.build(traced, mesh, mixed_precision, grouped_gathers, pricing, pipelined)
    t_build = time.perf_counter() - start - t_trace
    log.info("built strategy menus and costs in %.2fs", t_build)
    return Built(problem, t_trace, t_build)


def planning_trace(model, args, kwargs, mixed_precision=None):
    """The trace build_problem plans (cached per model and input shapes: autopar.trace.export)."""
    if mixed_precision is not None:
        args, kwargs = meta_inputs((tuple(args), kwargs))
        cast = TRACES.cast(model, mixed_precision.param_dtype, cast_for_trace)   # one copy per model and dtype
        return trace(cast, args, kwargs, unroll=True, shared=True)
    return trace(model, tuple(args), kwargs, unroll=True, shared=True)
