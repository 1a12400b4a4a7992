"""The exact presolve in front of the ILP: what needs no ILP folded into node costs.

Separable and single-choice edges, dominated and duplicate choices, nodes that dynamic
programming eliminates (chains, leaves, pairs of nodes joined into one).  Without a binding
memory budget that usually leaves nothing: a transformer graph is solved by elimination
alone.  `Presolve(costs, edges, memory, cap, allowed)`; `run()` folds; what is left is
`cost`, `edges`, `mem` (per kept node) plus `offset`; `expand(choice)` maps a choice of
the kept nodes back to every node.
"""
from __future__ import annotations

import copy

import numpy as np

_CHUNK = 1 << 22  # elements of one temporary [choices, choices, choices] array
LARGE_JOIN = 1 << 15  # the most choices a join made only to let eliminations finish may have (_merge_large)


class InfeasibleError(ValueError):
    """No plan fits the memory budget."""


def distinct(m: np.ndarray, axis: int = 0):
    """(m's distinct rows (axis 0) or columns (axis 1) in first-seen order, the index of
    each row or column among them): np.unique(axis=...) without its lexicographic sort,
    each row compared as one block of bytes."""
    m = np.ascontiguousarray(m if axis == 0 else m.T)
    if len(m) < 2 or m.shape[1] == 0:
        picked, index = m[:1], np.zeros(len(m), dtype=int)
    else:
        rows = m.view(np.dtype((np.void, m.dtype.itemsize * m.shape[1]))).ravel()
        _, first, of = np.unique(rows, return_index=True, return_inverse=True)
        order = np.argsort(first)
        rank = np.empty(len(order), dtype=int)
        rank[order] = np.arange(len(order))
        picked, index = m[first[order]], rank[of.ravel()]
    return (picked if axis == 0 else picked.T), index


def distinct_pairs(m: np.ndarray) -> int:
    """The pair variables an edge matrix costs: distinct rows x distinct columns."""
    rows, _ = distinct(m, 0)
    return rows.shape[0] * distinct(rows, 1)[0].shape[1]


class Presolve:
    """Exact reductions of the integer problem before any ILP variable is made.  Each keeps
    the optimal objective (some optimal assignment survives every step), so the plan is as
    good as the ILP over every choice would give; among equally good choices the lowest
    index (menu order) is kept, and that is the one the plan reports.

    - an edge matrix loses its row minima and then its column minima to the node costs
      (m = a[i] + b[j] + rest); a matrix then all zero (no coupling, as a separable or
      single-choice edge) is gone; a choice with no usable partner (a row or column all
      UNUSABLE) is dropped;
    - memory: a choice that cannot fit even with every other node at its smallest is
      dropped, and a budget that every assignment fits is no constraint at all;
    - elimination (variable elimination, as in dynamic programming over a chain): a node
      with one neighbour folds into it (its cost becomes min over its own choices); a node
      with two becomes one edge between them (min over its choices of the two edges plus
      its cost) when that edge costs no more pair variables than the two it replaces.
      Exact when the node's memory does not depend on its choice (views, gradient sums,
      every node when the budget does not bind); its choice is recovered from its
      neighbours' afterwards;
    - dominance (Goldstein's dead-end elimination): choice i of a node goes when some
      choice j is never worse whatever the neighbours choose,
      cost[j] - cost[i] + sum over edges of max_c (m[j, c] - m[i, c]) <= 0, and needs no
      more memory; identical choices (same cost, memory and edge rows) are the special
      case of equality, and keep the lowest index;
    - joining (when nothing above applies): two neighbours become one node over their
      compatible pairs of choices (_merge), and under a binding budget a leaf whose memory
      varies joins its neighbour keeping only its cost/memory Pareto-optimal choices
      (_fold_leaf).  Both are exact with any budget, and free further eliminations.

    No merging by mesh symmetry: a layout and its image under swapping two alike axes cost
    the same alone, but not against a neighbour that keeps the first, so they are not one
    choice (symmetry holds only for the whole plan at once)."""

    def __init__(self, costs, edges, memory, cap, allowed):
        self.n_nodes = len(costs)
        self.keep = {n: np.flatnonzero(a) for n, a in enumerate(allowed)}
        self.cost = {n: np.asarray(c, float)[self.keep[n]] for n, c in enumerate(costs)}
        self.mem = None if memory is None else {n: np.asarray(m, float)[self.keep[n]] for n, m in enumerate(memory)}
        self.cap = cap
        self.mem_offset = 0.0
        self.offset = 0.0
        self.edges: dict[tuple, np.ndarray] = {}   # (u, v), u < v -> [u's choices, v's choices]
        self.adj = {n: set() for n in self.cost}
        self.history = []      # eliminations and merges, in order (see expand)
        self.next_id = self.n_nodes
        self.dirty = set(self.cost)   # nodes whose dominance may have changed
        self.kept_back = set()        # nodes whose elimination was declined, unchanged since
        self.stale = set(self.cost)   # nodes whose costs or edges changed since _normalise saw them
        self.increases: dict = {}     # (n, w) -> (edge matrix, its max_increase from n's side)
        for u, v, m in edges:
            m = np.asarray(m, float)[np.ix_(self.keep[u], self.keep[v])]
            if u == v:
                self.cost[u] = self.cost[u] + np.diag(m)
            else:
                self._add_edge(u, v, m)
        self.before = self._size()

    def _size(self):
        return len(self.cost), sum(len(c) for c in self.cost.values()), len(self.edges), \
            sum(m.size for m in self.edges.values())

    def __str__(self) -> str:
        (n0, c0, e0, p0), (n1, c1, e1, p1) = self.before, self._size()
        done = [h[0] for h in self.history]
        budget = "binding" if self.mem is not None else "slack or none"
        return (f"{n0} nodes, {c0} choices, {e0} edges ({p0} choice pairs) -> {n1} nodes, {c1} choices, "
                f"{e1} edges ({p1} choice pairs); {done.count('eliminate')} nodes eliminated, "
                f"{done.count('merge')} joins, memory budget {budget}")

    # --- graph ------------------------------------------------------------------------------
    def _mat(self, u, v) -> np.ndarray:
        return self.edges[(u, v)] if u < v else self.edges[(v, u)].T

    def _add_edge(self, u, v, m):
        if u > v:
            u, v, m = v, u, m.T
        old = self.edges.get((u, v))
        self.edges[(u, v)] = m if old is None else old + m
        self.adj[u].add(v)
        self.adj[v].add(u)
        self._touch(u, v)

    def _del_edge(self, u, v):
        del self.edges[(min(u, v), max(u, v))]
        self.increases.pop((u, v), None)
        self.increases.pop((v, u), None)
        self.adj[u].discard(v)
        self.adj[v].discard(u)
        self._touch(u, v)

    def _touch(self, *nodes, stale=True):
        self.dirty.update(nodes)
        self.kept_back.difference_update(nodes)
        if stale:
            self.stale.update(nodes)

    def _drop_node(self, g):
        self._touch(*self.adj[g])
        del self.cost[g], self.adj[g]
        if self.mem is not None:
            del self.mem[g]
        self.dirty.discard(g)

    def _restrict(self, n, sel) -> bool:
        if sel.all():
            return False
        if not sel.any():
            raise InfeasibleError("no assignment of strategies fits the memory budget")
        self.keep[n], self.cost[n] = self.keep[n][sel], self.cost[n][sel]
        if self.mem is not None:
            self.mem[n] = self.mem[n][sel]
        for w in self.adj[n]:
            key = (min(n, w), max(n, w))
            self.edges[key] = self.edges[key][sel, :] if n < w else self.edges[key][:, sel]
        self._touch(n, *self.adj[n])
        return True

    # --- reductions -------------------------------------------------------------------------
    def run(self):
        self._reduce()
        if self.mem is not None or not self.cost:
            return
        # joins beyond the largest menu (_merge_large), kept only where they let the
        # eliminations finish the problem or leave CP-SAT fewer pair variables: on meshes of
        # three axes they could leave ten times the pairs they started from
        before = self._snapshot()
        while self.cost and self._merge_large():
            self._reduce()
        if self.cost and self._pair_variables() > before["pairs"]:
            self._restore(before)

    def _reduce(self):
        while True:
            changed = self._fit_memory()
            changed |= self._normalise()
            changed |= self._eliminate()
            if not changed and not self._dominate() and not self._merge():
                return

    def _pair_variables(self) -> int:
        return sum(distinct_pairs(m) for m in self.edges.values())

    _STATE = ("keep", "cost", "mem", "edges", "increases", "history", "dirty", "kept_back", "stale")

    def _snapshot(self) -> dict:
        """What _restore needs to undo the reductions after it (arrays are replaced, never
        written in place, so copies of the containers suffice)."""
        state = {k: copy.copy(getattr(self, k)) for k in self._STATE}
        state["adj"] = {n: set(v) for n, v in self.adj.items()}
        state.update(next_id=self.next_id, offset=self.offset, mem_offset=self.mem_offset,
                     pairs=self._pair_variables())
        return state

    def _restore(self, state: dict) -> None:
        for k in self._STATE + ("adj", "next_id", "offset", "mem_offset"):
            setattr(self, k, state[k])

    def _fit_memory(self) -> bool:
        if self.mem is None:
            return False
        left = self.cap - self.mem_offset
        low = {n: m.min() for n, m in self.mem.items()}
        floor = sum(low.values())
        if floor > left:
            raise InfeasibleError("no assignment of strategies fits the memory budget")
        changed = False
        for n in list(self.mem):
            changed |= self._restrict(n, self.mem[n] + (floor - low[n]) <= left)
        if sum(m.max() for m in self.mem.values()) <= left:
            self.mem = None  # every assignment fits
            self._touch(*self.cost)
            changed = True
        return changed

    def _normalise(self) -> bool:
        """Only around the nodes changed since the last call (self.stale): an edge
        normalised before and not changed since has zero row and column minima still."""
        changed = False
        seen, self.stale = self.stale, set()
        for n in sorted(seen & self.cost.keys()):
            changed |= self._restrict(n, np.isfinite(self.cost[n]))
        for (u, v) in [e for e in self.edges if e[0] in seen or e[1] in seen]:
            m = self.edges[(u, v)]
            changed |= self._restrict(u, np.isfinite(m.min(axis=1)))
            changed |= self._restrict(v, np.isfinite(self.edges[(u, v)].min(axis=0)))
            m = self.edges[(u, v)]
            for n, axis in ((u, 1), (v, 0)):
                low = m.min(axis=axis)
                if low.any():
                    m = m - np.expand_dims(low, axis)
                    self.cost[n] = self.cost[n] + low
                    self._touch(u, v, stale=False)
            if not m.any():
                self._del_edge(u, v)
                changed = True
            else:
                self.edges[(u, v)] = m
        return changed

    def _eliminate(self) -> bool:
        changed = False
        for g in sorted(self.cost):
            if g not in self.cost or len(self.adj[g]) > 2 or g in self.kept_back:
                continue
            near = sorted(self.adj[g])
            if self.mem is not None and self.mem[g].min() != self.mem[g].max():
                if len(near) == 1 and self._fold_leaf(g, near[0]):
                    changed = True
                else:
                    self.kept_back.add(g)
                continue
            if not near:
                pick, snap = np.array(int(np.argmin(self.cost[g]))), ()
                self.offset += float(self.cost[g][pick])
            elif len(near) == 1:
                (a,) = near
                t = self._mat(a, g) + self.cost[g][None, :]
                pick = t.argmin(axis=1)
                self.cost[a] = self.cost[a] + t[np.arange(len(pick)), pick]
                snap = (self.keep[a].copy(),)
            else:
                a, b = near
                ma, mb = self._mat(a, g), self._mat(g, b)
                pick, through = min_through(ma, self.cost[g], mb)
                direct = self._mat(a, b) if b in self.adj[a] else None
                old = distinct_pairs(ma) + distinct_pairs(mb) + (0 if direct is None else distinct_pairs(direct))
                if distinct_pairs(through if direct is None else through + direct) > old:
                    self.kept_back.add(g)
                    continue
                snap = (self.keep[a].copy(), self.keep[b].copy())
            if self.mem is not None:
                self.mem_offset += float(self.mem[g][0])
            self.history.append(("eliminate", g, tuple(near), snap, self.keep[g][pick]))
            for w in near:
                self._del_edge(g, w)
            if len(near) == 2:
                self._add_edge(near[0], near[1], through)
            self._drop_node(g)
            changed = True
        return changed

    def _dominate(self) -> bool:
        changed = False
        for n in sorted(self.dirty):
            if n not in self.cost or len(self.cost[n]) < 2:
                continue
            c = self.cost[n]
            k = len(c)
            worse = c[:, None] - c[None, :]   # [j, i]: what switching from i to j can cost
            for w in self.adj[n]:
                worse = worse + self._increase(n, w)
            order = np.arange(k)
            kill = (worse < 0) | ((worse == 0) & (order[:, None] < order[None, :]))
            if self.mem is not None:
                kill &= self.mem[n][:, None] <= self.mem[n][None, :]
            np.fill_diagonal(kill, False)
            changed |= self._restrict(n, ~kill.any(axis=0))
        self.dirty.clear()
        return changed

    def _increase(self, n, w) -> np.ndarray:
        """max_increase of n's edge to w, kept while that edge's matrix is unchanged (a node
        made dirty by one neighbour keeps its other edges)."""
        m = self.edges[(min(n, w), max(n, w))]
        held = self.increases.get((n, w))
        if held is None or held[0] is not m:
            held = self.increases[(n, w)] = (m, max_increase(self._mat(n, w)))
        return held[1]

    def _merge(self) -> bool:
        """Join two neighbours into one node whose choices are their compatible pairs (the
        finite entries of their edge), when that is no bigger than the largest menu and
        costs no more pair variables: a tensor and the sum of its gradients, whose layouts
        must agree, are the typical pair.  It leaves their other neighbours with fewer
        neighbours to eliminate.  Exact with any budget (memory adds up)."""
        limit = max((len(c) for c in self.cost.values()), default=0)
        sizes = sorted((int(np.isfinite(m).sum()), u, w) for (u, w), m in self.edges.items())
        for size, u, w in sizes:
            if size > limit:
                return False
            m = self.edges[(u, w)]
            iu, iw = np.nonzero(np.isfinite(m))
            old = sum(distinct_pairs(self._mat(n, x)) for n in (u, w) for x in self.adj[n] if (n, x) != (w, u))
            joined = self._joined(u, w, iu, iw)
            if sum(distinct_pairs(j) for j in joined.values()) > old:
                continue
            self._join(u, w, iu, iw, joined)
            return True
        return False

    def _merge_large(self) -> bool:
        """When nothing else applies and the budget does not bind: join the two neighbours
        whose join has the fewest choices, even beyond the largest menu, within LARGE_JOIN
        choices and _CHUNK entries of edges around it.  Exact (as _merge); on meshes of
        three axes the menus are large and the graph's cycles (residual streams) stop the
        eliminations, and a few such joins let them finish the problem without CP-SAT."""
        if self.mem is not None:
            return False
        best = None
        for (u, w), m in self.edges.items():
            size = int(np.isfinite(m).sum())
            if size > LARGE_JOIN or (best is not None and size >= best[0]):
                continue
            around = (self.adj[u] | self.adj[w]) - {u, w}
            if size * sum(len(self.cost[x]) for x in around) <= _CHUNK:
                best = (size, u, w)
        if best is None:
            return False
        _, u, w = best
        iu, iw = np.nonzero(np.isfinite(self.edges[(u, w)]))
        self._join(u, w, iu, iw, self._joined(u, w, iu, iw))
        return True

    def _joined(self, u, w, iu, iw) -> dict:
        """The edge matrices of the join of u and w over the pairs (iu[k], iw[k]) to each of
        their other neighbours."""
        return {x: sum(self._mat(n, x)[i] for n, i in ((u, iu), (w, iw)) if x in self.adj[n])
                for x in sorted((self.adj[u] | self.adj[w]) - {u, w})}

    def _fold_leaf(self, g, a) -> bool:
        """A node g whose only neighbour is a, under a binding budget and with memory that
        depends on its choice, cannot be eliminated (the cheapest choice may not be the one
        that fits).  It joins a instead, keeping for each choice of a only g's choices on
        the cost/memory Pareto front (cheaper, or else smaller): a parameter next to the op
        that reads it keeps its plain layout and the ZeRO variants that save memory.  a's
        other edges keep their distinct rows, so they cost no new pair variables."""
        m = self._mat(a, g) + self.cost[g][None, :]
        mem = np.broadcast_to(self.mem[g], m.shape)
        order = np.lexsort((np.broadcast_to(np.arange(m.shape[1]), m.shape), mem, m), axis=1)  # cost, memory, index
        cost, mem = np.take_along_axis(m, order, axis=1), np.take_along_axis(mem, order, axis=1)
        before = np.minimum.accumulate(np.concatenate([np.full((len(m), 1), np.inf), mem[:, :-1]], axis=1), axis=1)
        iu, at = np.nonzero((mem < before) & np.isfinite(cost))   # each smaller than every cheaper one
        if len(iu) > len(self.cost[a]) + m.shape[1] + distinct_pairs(self._mat(a, g)):
            return False
        joined = {x: self._mat(a, x)[iu] for x in self.adj[a] if x != g}
        self._join(a, g, iu, order[iu, at], joined)
        return True

    def _join(self, u, w, iu, iw, joined):
        """Replace u and w by one node whose choices are the pairs (iu[k], iw[k]); joined:
        its edge matrix to each of their other neighbours."""
        new = self.next_id
        self.next_id += 1
        self.history.append(("merge", new, u, w, self.keep[u][iu], self.keep[w][iw]))
        m = self._mat(u, w)
        self.cost[new] = self.cost[u][iu] + self.cost[w][iw] + m[iu, iw]
        if self.mem is not None:
            self.mem[new] = self.mem[u][iu] + self.mem[w][iw]
        self.keep[new] = np.arange(len(iu))
        self.adj[new] = set()
        for n in (u, w):
            for x in list(self.adj[n]):
                self._del_edge(n, x)
            self._drop_node(n)
        for x, j in joined.items():
            self._add_edge(new, x, j)
        self._touch(new)

    def expand(self, choice: dict) -> list:
        """The choice (original index) of every node from those of the nodes left to the ILP."""
        choice = dict(choice)
        for step in reversed(self.history):
            if step[0] == "eliminate":
                _, g, near, snap, pick = step
                at = tuple(int(np.searchsorted(k, choice[w])) for w, k in zip(near, snap))
                assert all(k[i] == choice[w] for i, w, k in zip(at, near, snap)), "a choice the presolve dropped"
                choice[g] = int(pick[at])
            else:
                _, new, u, w, at_u, at_w = step
                choice[u], choice[w] = int(at_u[choice[new]]), int(at_w[choice[new]])
        return [choice[n] for n in range(self.n_nodes)]


def min_through(ma: np.ndarray, cost: np.ndarray, mb: np.ndarray):
    """Eliminating a middle node: for each pair (i of a, k of b), the middle choice j that
    minimises ma[i, j] + cost[j] + mb[j, k], and that minimum.  Computed once per distinct
    row of ma and column of mb (a node's choices that differ only in what the other
    neighbour never sees meet it alike), the middle choices along contiguous memory: on
    DeepSeek-V3's whole-mesh problem 3-8x faster than over the matrices as given (often
    transposed views)."""
    ra, row_of = distinct(ma, 0)
    cb, col_of = distinct(mb, 1)
    a = ra + cost[None, :]
    bt = np.ascontiguousarray(cb.T)   # [k, j]
    rows = max(1, _CHUNK // max(1, a.shape[1] * bt.shape[0]))
    pick = np.empty((a.shape[0], bt.shape[0]), dtype=int)
    best = np.empty((a.shape[0], bt.shape[0]))
    for lo in range(0, a.shape[0], rows):
        t = a[lo:lo + rows, None, :] + bt[None, :, :]   # [i, k, j]
        got = pick[lo:lo + rows] = t.argmin(axis=2)
        best[lo:lo + rows] = np.take_along_axis(t, got[:, :, None], axis=2)[:, :, 0]
    return pick[np.ix_(row_of, col_of)], best[np.ix_(row_of, col_of)]


def max_increase(m: np.ndarray) -> np.ndarray:
    """[j, i]: max over the neighbour's choices c of m[j, c] - m[i, c], leaving out the c
    that row i cannot meet (UNUSABLE there: that pair never happens)."""
    m, row_of = distinct(m, 0)   # equal rows, equal columns: once
    m = np.ascontiguousarray(distinct(m, 1)[0])
    k = m.shape[0]
    rows = max(1, _CHUNK // max(1, k * m.shape[1]))
    out = np.empty((k, k))
    for lo in range(0, k, rows):
        with np.errstate(invalid="ignore"):
            d = m[lo:lo + rows, None, :] - m[None, :, :]
        out[lo:lo + rows] = np.fmax.reduce(d, axis=2)   # (NaN, both UNUSABLE: left out)
    out[np.isnan(out)] = -np.inf   # (no column either row can meet)
    return out[np.ix_(row_of, row_of)]
