"""The planning problem: every graph node with its strategy menu and costs, every edge with
its resharding costs, identical layers folded into one set of choices.

Built once per (graph, mesh) by Problem.build from pieces that each do one thing, in this
order: the graph walk (graph.py), the layer sharing (layers.py), the menus (menus.py), what
the backend fuses (fusion.py), what ops keep for backward (saved_memory.py), each node's
prices (node_prices.py), where gradients go (gradient_paths.py), every edge's prices
(edge_prices.py) and its collectives per pair of choices (edge_steps.py).  Solved for the
best plan and for the hand-written layouts (the same problem with menus restricted;
ilp/reduce.py folds it for the ILP).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from autopar.mesh import Mesh
from autopar.solve.problem.edge_prices import EdgePrices
from autopar.solve.problem.edge_steps import EdgeSteps
from autopar.solve.problem.fusion import fused_chains
from autopar.solve.problem.gradient_paths import GradientPaths
from autopar.solve.problem.graph import EdgeKey, add_gradient_sums, build_nodes, concrete_edges
from autopar.solve.problem.layers import StandIns, share_layers, stand_ins
from autopar.solve.problem.menus import build_menus, stage_data_axes
from autopar.solve.problem.node_prices import NodePrices
from autopar.solve.problem.pricing import Pricing, Remembered
from autopar.solve.problem.saved_memory import SavedMemory
from autopar.trace.export import Traced


@dataclass(frozen=True, eq=False)
class Problem:
    """A traced graph on a mesh, priced.  Settings: precision (an autopar.MixedPrecision, the
    graph then traced from the model cast to its param_dtype, or None), pricing (Pricing),
    grouped_gathers (whether the runtime gathers ZeRO-3 weights in buckets: it does for a
    whole model, not inside pipeline stages), pipelined (a pipeline stage's problem,
    pipeline/costs.stage_problem).  Graph: nodes (PNode, by_fx: fx name -> index), readers
    ((node, output) -> its readers), gradsum_of (tensor -> its gradient-sum node), the layer
    sharing (layer_groups, tie, block) and the menus' fallback_ops and warnings.  Pieces:
    saved (SavedMemory), node_prices (NodePrices: `choices`), paths (GradientPaths), steps
    (EdgeSteps), edge_prices (EdgePrices); edges (every concrete edge), edge_classes (edge
    between representatives -> how many edges it stands for), counts (representative ->
    nodes it stands for), edge_costs (EdgePrices.costs, or an overlapped copy's), remembered
    (Remembered, shared with overlapped copies)."""

    traced: Traced
    mesh: Mesh
    precision: object
    pricing: Pricing
    grouped_gathers: bool
    pipelined: bool
    nodes: list
    by_fx: dict
    readers: dict
    gradsum_of: dict
    layer_groups: list
    tie: dict
    block: dict
    fallback_ops: list
    warnings: list
    saved: SavedMemory
    node_prices: NodePrices
    paths: GradientPaths
    steps: EdgeSteps
    edge_prices: EdgePrices
    edges: list
    edge_classes: dict
    counts: dict
    edge_costs: dict
    remembered: Remembered
    edge_reps: dict   # concrete edge -> the edge between its ends' representatives (rep_edge)
    # what each node stands for in a shortened trace (autopar/trace/shortened.py): the ILP
    # counts its costs that many times (reduce_problem)
    stand_ins: StandIns = StandIns({}, {})

    @classmethod
    def build(cls, traced: Traced, mesh: Mesh, precision=None, grouped_gathers: bool = True,
              pricing: Pricing | None = None, pipelined: bool = False) -> "Problem":
        """The problem of `traced` on `mesh` (the class docstring names the settings)."""
        pricing = pricing or Pricing()
        remembered = Remembered(mesh)
        nodes, by_fx = build_nodes(traced)
        readers, gradsum_of = add_gradient_sums(nodes)
        shared = share_layers(nodes, readers, gradsum_of)
        fallback_ops, warnings = build_menus(nodes, readers, mesh, stage_data_axes(mesh) if pipelined else ())
        ins = stand_ins(nodes, shared.block, traced.layers, traced.weights)
        saved = SavedMemory(nodes, mesh, pricing.backend, shared.block, remembered, ins.holders)
        prices = NodePrices(nodes, mesh, pricing, precision is not None,
                            fused_chains(nodes, readers, pricing.backend), saved, remembered)
        paths = GradientPaths(nodes, readers, gradsum_of, remembered)
        edges = concrete_edges(nodes, gradsum_of)
        edge_classes: dict[EdgeKey, int] = {}
        edge_reps: dict[EdgeKey, EdgeKey] = {}
        counts: dict[int, int] = {}
        for e in edges:
            key = edge_reps[e] = e._replace(a=nodes[e.a].rep, b=nodes[e.b].rep)
            edge_classes[key] = edge_classes.get(key, 0) + 1
        for pn in nodes:
            counts[pn.rep] = counts.get(pn.rep, 0) + 1
        edge_prices = EdgePrices(nodes, readers, pricing, grouped_gathers, prices.choices, paths, edge_classes)
        return cls(traced, mesh, precision, pricing, grouped_gathers, pipelined, nodes, by_fx, readers, gradsum_of,
                   shared.layer_groups, shared.tie, shared.block, fallback_ops, warnings, saved, prices, paths,
                   EdgeSteps(nodes, pricing, grouped_gathers, paths, remembered), edge_prices, edges, edge_classes,
                   counts, edge_prices.costs, remembered, edge_reps, ins)

    @property
    def choices(self) -> dict:
        """rep -> one Choice per strategy (NodePrices.choices)."""
        return self.node_prices.choices

    def overlapped(self, hidden: float, prefetched: float = 0.0, linear_most: bool = False) -> "Problem":
        """This problem with each parameter gradient's bucketed reduction priced at
        (1 - hidden) of its seconds and each weight's forward gathers at (1 - prefetched):
        a linear stand-in for the overlap of gradient buckets with backward
        (assemble.hidden_gradient_seconds) and of prefetched gathers with forward
        (assemble.hidden_prefetch_seconds), the shares being what a plan hides.
        linear_most: a tensor several linears read has its input gradient's collective
        priced as hidden by the most their weight gradients could (for a bound).  The copy
        shares everything but its edge costs."""
        ep = self.edge_prices
        costs = {k: m - hidden * ep.bucketed.get(k, 0.0) - prefetched * ep.gathers.get(k, 0.0)
                 - (ep.linear_slack.get(k, 0.0) if linear_most else 0.0)
                 for k, m in self.edge_prices.costs.items()}
        return dataclasses.replace(self, edge_costs=costs)

    def rep_edge(self, e: EdgeKey) -> EdgeKey:
        """Edge e between the representatives of its ends."""
        rep = self.edge_reps.get(e)
        return rep if rep is not None else e._replace(a=self.nodes[e.a].rep, b=self.nodes[e.b].rep)

    def node_cost(self, rep: int) -> np.ndarray:
        return np.array([c.time for c in self.choices[rep]])

    def node_memory(self, rep: int) -> np.ndarray:
        return np.array([sum(c.memory.values()) for c in self.choices[rep]])

    def node_activations(self, rep: int) -> np.ndarray:
        return np.array([c.memory["activations"] for c in self.choices[rep]])

    def node_work(self, rep: int) -> np.ndarray:
        return np.array([c.work for c in self.choices[rep]])

    def node_plain_memory(self, rep: int) -> np.ndarray:
        return np.array([sum(c.memory.values()) if c.plain_memory is None else c.plain_memory
                         for c in self.choices[rep]])
