"""A schedule's passes as a graph in arrays (PassGraph), and the times of its passes.

The simulator (autopar.cost.schedules) builds one PassGraph per (schedule, stages,
microbatches, chunks): which pass waits for which depends on these only, not on the pass
times, so every simulation of that shape after the first is one pass over the arrays in
dependency order (pass_spans), adding times.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

from autopar.cost.schedule_orders import peak_in_flight


@dataclass(frozen=True)
class PassGraph:
    """A schedule's passes in an order where each comes after the passes it waits for:
    per pass its rank, its slot (rank, kind, chunk: an index into that rank's pass times)
    and the positions of the passes on other ranks it waits for, first and second (-1:
    none; a pass waits for at most two, a forward paired with a backward under dualpipev;
    its own rank's come before it in the rank's order); with how many passes each slot has
    and each rank's peak in flight.  Arrays of ints: 64 ranks x 512 microbatches of
    dualpipev hold 200,000 passes."""

    rank: array
    slot: array
    micro: array
    first: array
    second: array
    slot_counts: tuple
    in_flight: tuple


def order_passes(orders: list, pairs: dict, kinds: tuple, v: int, B: int, inputs, schedule: str) -> PassGraph:
    """Every rank's `orders` (passes of `kinds` on B microbatches and v chunks) walked into
    one order where each pass comes after those it waits for: inputs(rank, op), the (rank,
    op) pairs `op` waits for, alike for every microbatch; pairs: {(rank, forward op):
    backward op} run as one (dualpipev), the forward also waiting for the backward's
    inputs.  A pass's slot is (rank len(kinds) + kind) v + chunk.  Raises RuntimeError where
    the orders deadlock (`schedule` names them in the errors)."""
    S = len(orders)
    info = _input_table(S, kinds, v, B, inputs)
    where = array("i", [-1]) * (S * len(kinds) * v * B)   # pass id -> its position in the walk
    rank, slot, micro, first, second = array("i"), array("i"), array("i"), array("i"), array("i")
    pos = [0] * S
    waiting: dict = {}
    todo, queued = list(range(S - 1, -1, -1)), [True] * S
    while todo:   # ranks advanced in any order: one blocked on a pass not yet placed waits for it
        r = todo.pop()
        queued[r] = False
        order = orders[r]
        while pos[r] < len(order):
            op = order[pos[r]]
            kind, m, c = op
            at, base, ins = info[r, kind, c]
            me = base + m
            inputs = [(r2, b2 + m) for r2, b2 in ins]
            partner = pairs.get((r, op)) if pairs else None
            if partner is not None:
                inputs += [(r2, b2 + partner[1]) for r2, b2 in info[r, partner[0], partner[2]][2]
                           if b2 + partner[1] != me]
            missing = -1
            for _, i in inputs:
                if where[i] < 0:
                    missing = i
                    break
            if missing >= 0:
                waiting.setdefault(missing, []).append(r)
                break
            where[me] = len(rank)
            rank.append(r)
            slot.append(at)
            micro.append(m)
            a = b = -1
            for r2, i in inputs:
                if r2 != r:
                    if a < 0:
                        a = where[i]
                    elif b < 0:
                        b = where[i]
                    else:
                        raise AssertionError(f"{schedule}: {op} on rank {r} waits for more than two other ranks' "
                                             f"passes")
            first.append(a)
            second.append(b)
            pos[r] += 1
            blocked = waiting.pop(me, None)
            if blocked:
                for r3 in blocked:
                    if not queued[r3]:
                        queued[r3] = True
                        todo.append(r3)
    if any(p < len(o) for p, o in zip(pos, orders)):
        stuck = {r: orders[r][pos[r]] for r in range(S) if pos[r] < len(orders[r])}
        raise RuntimeError(f"schedule deadlocks; next op per rank: {stuck}")
    in_flight = [peak_in_flight([op[0] for op in order]) for order in orders]   # (a rank runs them in order)
    counts: dict = {}
    for x in slot:
        counts[x] = counts.get(x, 0) + 1
    return PassGraph(rank, slot, micro, first, second, tuple(counts.items()), tuple(in_flight))


def _input_table(S: int, kinds: tuple, v: int, B: int, inputs) -> dict:
    """(rank, kind, chunk) -> (slot, id of microbatch 0, its inputs as (rank, id of
    microbatch 0)).  Every pass waits on passes of its own microbatch, so the table holds
    microbatch 0's; a pass's id is ((rank K + kind) v + chunk) B + m, K kinds."""
    K = len(kinds)
    kind_index = {k: i for i, k in enumerate(kinds)}
    info = {}
    for r in range(S):
        for kind in kinds:
            for c in range(v):
                at = (r * K + kind_index[kind]) * v + c
                info[r, kind, c] = (at, at * B, tuple(
                    (r2, ((r2 * K + kind_index[op2[0]]) * v + op2[2]) * B)
                    for r2, op2 in inputs(r, (kind, 0, c))))
    return info


def pass_spans(graph: PassGraph, slot_time: list, S: int, comm_time: float, with_ranks: bool = False) -> tuple:
    """(start, end) of every pass of `graph`, in its order: each starts when its rank is
    free and what it waits for from other ranks has arrived (comm_time after it ended).
    with_ranks: also when each rank's last pass ends."""
    n = len(graph.slot)
    start, end = [0.0] * n, [0.0] * n
    free = [0.0] * S
    i = 0
    for r, slot, a, b in zip(graph.rank, graph.slot, graph.first, graph.second):
        t = free[r]
        if a >= 0:
            arrive = end[a] + comm_time
            if arrive > t:
                t = arrive
            if b >= 0:
                arrive = end[b] + comm_time
                if arrive > t:
                    t = arrive
        start[i] = t
        end[i] = free[r] = t + slot_time[slot]
        i += 1
    if with_ranks:
        return start, end, free
    return start, end
