"""The ILP's view of a Problem: followers folded into their producers, costs multiplied by
the layers that share them."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopar.ops import TRIVIAL
from autopar.solve.problem.problem import Problem
from autopar.solve.problem.graph import EdgeKey, PNode
from autopar.solve.problem.layers import SHARE_PERIOD

# Ops folded into their producer's choice (they take the layout it offers); not the alias
# a shared tensor's readers read (trace.share_reads), whose layout change is its point.
FOLLOWERS = TRIVIAL - {"aten.alias"}


@dataclass
class Reduced:
    """The ILP view of a Problem: one variable node per root, follower maps to recover the rest."""

    roots: list            # rep index per ILP node
    costs: list            # np arrays, totals over all instances
    memory: list
    plain_memory: list     # memory as the tie-break sees it (Choice.plain_memory)
    edges: list            # (ilp u, ilp v, matrix)
    allowed: list
    root_of: dict          # rep -> rep of its root
    follow: dict           # rep -> np array: rep's choice for each root choice
    canon: object          # rep -> the rep whose choice it takes (period 1 ties odd layers to even)
    work: list = None      # per root choice: the most working memory of one op it and its followers run


def reduce_problem(problem: Problem, allowed_fn=None, period: int = SHARE_PERIOD, modes=None) -> Reduced:
    """Fold followers (views and unary elementwise ops take the layout their producer offers)
    into their producers and multiply every cost by the number of layers sharing it.

    period 1 ties odd layers to even ones too (every identical layer the same choice):
    half the variables; period 2 lets layouts alternate from layer to layer.  modes: an
    autopar.solve.recompute.modes.ModeCosts (the activation bytes and the forward run again of the
    layers it recomputes), or None (every layer keeps its activations)."""
    nodes = problem.nodes

    def canon(r):
        return problem.tie.get(r, r) if period == 1 else r

    reps = sorted({canon(pn.rep) for pn in nodes})
    counts: dict[int, int] = {}
    weight = problem.stand_ins.weight   # (1, but in a shortened trace)
    for pn in nodes:
        counts[canon(pn.rep)] = counts.get(canon(pn.rep), 0) + weight(pn.index)
    classes, edge_costs, extra_edges = _edge_classes(problem, canon, modes)
    mask = {r: _allowed(problem, nodes[r], allowed_fn) for r in reps}
    tables = _node_tables(problem, reps, counts, canon, modes)
    root_of, follow, used_edges = _fold_followers(nodes, reps, counts, classes, edge_costs, extra_edges, mask, tables)
    cost, mem, plain, work = tables
    roots = [r for r in reps if root_of[r] == r]
    index = {r: i for i, r in enumerate(roots)}
    edges = []
    for key, count in classes.items():
        if key in used_edges:
            continue
        m = edge_costs[key] * count + extra_edges.get(key, 0.0)
        m = m[np.ix_(follow[key.a], follow[key.b])]
        edges.append((index[root_of[key.a]], index[root_of[key.b]], m))
    return Reduced(roots, [cost[r] for r in roots], [mem[r] for r in roots], [plain[r] for r in roots], edges,
                   [mask[r] for r in roots], root_of, follow, canon, [work[r] for r in roots])


def _edge_classes(problem: Problem, canon, modes) -> tuple:
    """(edge class under `canon` -> how many edges it stands for, -> its cost matrix, -> the
    seconds `modes` add to it)."""
    classes: dict[EdgeKey, int] = {}
    edge_costs: dict[EdgeKey, np.ndarray] = {}
    for e in problem.edges:
        rep = problem.rep_edge(e)
        key = rep._replace(a=canon(rep.a), b=canon(rep.b))
        classes[key] = classes.get(key, 0) + problem.stand_ins.edge_weight(e.a, e.b)
        edge_costs.setdefault(key, problem.edge_costs[rep])
    extra_edges: dict = {}
    if modes is not None:
        for rep, m in modes.edge_extra.items():
            key = rep._replace(a=canon(rep.a), b=canon(rep.b))
            extra_edges[key] = extra_edges.get(key, 0.0) + m
    return classes, edge_costs, extra_edges


def _allowed(problem: Problem, pn, allowed_fn) -> np.ndarray:
    """Which of pn's strategies `allowed_fn` keeps (all where it keeps none: the restriction
    does not speak to this node)."""
    m = np.array([True if allowed_fn is None else bool(allowed_fn(problem, pn, s)) for s in pn.strategies])
    if not m.any():
        m[:] = True
    return m


def _node_tables(problem: Problem, reps: list, counts: dict, canon, modes) -> tuple:
    """(seconds, memory, plain memory, working bytes) per representative and choice, costs
    multiplied by the nodes each stands for; under `modes`, activations as the modes keep
    them and the forward run again."""
    cost = {r: problem.node_cost(r) * counts[r] for r in reps}
    mem = {r: problem.node_memory(r) * counts[r] for r in reps}
    plain = {r: problem.node_plain_memory(r) * counts[r] for r in reps}
    work = {r: problem.node_work(r) for r in reps}
    if modes is not None:
        for r in reps:
            act = problem.node_activations(r) * counts[r]
            mem[r] = mem[r] - act
            plain[r] = plain[r] - act
        for rep, arr in modes.activations.items():
            mem[canon(rep)] = mem[canon(rep)] + arr
            plain[canon(rep)] = plain[canon(rep)] + arr
        for rep, arr in modes.extra.items():
            cost[canon(rep)] = cost[canon(rep)] + arr
    return cost, mem, plain, work


def _fold_followers(nodes: list, reps: list, counts: dict, classes: dict, edge_costs: dict, extra_edges: dict,
                    mask: dict, tables: tuple) -> tuple:
    """(root_of, follow, folded edges): each follower (FOLLOWERS, read from one producer by
    every node it stands for) folded into its producer's root, its costs and its edge's
    added to the root's `tables` (in place) per root choice; follow[r]: r's choice per
    choice of its root."""
    cost, mem, plain, work = tables
    incoming: dict[int, list] = {}
    for key in classes:
        if key.kind == "data":
            incoming.setdefault(key.b, []).append(key)
    root_of, follow = {}, {}
    used_edges = set()
    for r in reps:
        pn = nodes[r]
        keys = incoming.get(r, [])
        this_map = None
        if (pn.kind == "op" and pn.op in FOLLOWERS and len(keys) == 1 and len(pn.strategies) > 1
                and classes[keys[0]] == counts[r] and keys[0].a != r
                and len(nodes[keys[0].a].strategies) > 1):
            key = keys[0]
            src = key.a
            this_map = pass_through(nodes[src], follow[src], key.out, pn, key.operand, mask[r])
        if this_map is not None:
            root = root_of[src]
            edge = edge_costs[key] * classes[key] + extra_edges.get(key, 0.0)
            for s_root, (s_src, t) in enumerate(zip(follow[src], this_map)):
                cost[root][s_root] += edge[s_src, t] + cost[r][t]
                mem[root][s_root] += mem[r][t]
                plain[root][s_root] += plain[r][t]
                work[root][s_root] = max(work[root][s_root], work[r][t])
            root_of[r], follow[r] = root, this_map
            used_edges.add(key)
        else:
            root_of[r], follow[r] = r, np.arange(len(pn.strategies))
    return root_of, follow, used_edges


def pass_through(src: PNode, src_map, out: int, pn: PNode, operand: int, mask):
    """For each choice of the producer's root, the follower strategy that takes the producer's
    layout unchanged; None when some producer layout has no such strategy (then the node is
    planned on its own: a view cannot take a Partial tensor's layout greedily)."""
    by_input = {}
    for t, s in enumerate(pn.strategies):
        if mask[t]:
            by_input.setdefault(s.inputs[operand], t)
    result = np.zeros(len(src_map), dtype=int)
    for k, s_src in enumerate(src_map):
        t = by_input.get(src.strategies[s_src].outputs[out])
        if t is None:
            return None
        result[k] = t
    return result


