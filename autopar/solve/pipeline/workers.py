"""How the pipeline search's candidates are traced and costed on the cores this process may
use (autopar/solve/forked.py): which process exports which trace, what they send each
other, and what each hands back (Costed).

Keys (sub-mesh shape, microbatch rows) are grouped by microbatch size (one trace serves a
group) and the groups dealt to the processes (deal).  This process exports the whole batch
and a forked one the largest other microbatch size, at the same time; each sends the other
its trace's outline, from which with its own it writes every other size
(autopar/trace/rebatch.py: 0.07 s against 0.6 s for an export of llama3-8b).  Further
processes get both outlines, but a trace is written from an export cached in the same
process, and they fork before any: each exports its first size once, then writes the rest
(tests/test_pipeline_search.py counts the exports).  No process exports more than once.
"""
from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass

from autopar.solve.forked import forked_lanes, forked_map, worker_count
from autopar.solve.pipeline.costs import StageCosts
from autopar.solve.built import planning_trace
from autopar.trace.batching import first_microbatch
from autopar.trace.cache import TRACES

log = logging.getLogger("autopar")

TRACE_WEIGHT = 0.2   # what writing a group's trace adds to its load in deal (one per key)
WHOLE_WEIGHT = 2.5   # per key of the whole batch's group: planned whole (its trace is 4-5 times the others')


@dataclass(frozen=True)
class Costed:
    """What one process hands back: `lane` (0: this process, k: the k-th forked one), the
    LayerCosts (or None: no plan fits) of every key of its share, and the seconds it took."""

    lane: int
    costs: dict
    seconds: float

    def __str__(self) -> str:
        return f"lane {self.lane}: {len(self.costs)} candidate sub-problems costed in {self.seconds:.1f}s"


def groups_of(keys) -> dict:
    """Microbatch rows -> the keys of that size (one trace serves them), in order."""
    out: dict = {}
    for key in keys:
        out.setdefault(key[1], []).append(key)
    return out


def deal(groups: dict, lanes: int, placed: dict) -> list:
    """Shares of `lanes` processes, each a list of groups (groups_of): `placed` (lane ->
    group) first, the others largest first, each to the least loaded process.  A group
    weighs one per key, plus TRACE_WEIGHT for writing its trace; the whole batch's (the
    first group) WHOLE_WEIGHT per key, and a placed group no more."""
    shares = [[] for _ in range(lanes)]
    loads = [0.0] * lanes
    first = next(iter(groups))
    for lane, group in placed.items():
        shares[lane].append(group)
        loads[lane] += len(group) * (WHOLE_WEIGHT if group is groups[first] else 1.0)
    for group in sorted((g for g in groups.values() if not any(g is p for p in placed.values())),
                        key=lambda g: -len(g)):
        lane = loads.index(min(loads))
        loads[lane] += len(group) + TRACE_WEIGHT
        shares[lane].append(group)
    return shares


def trace_and_cost(costs: StageCosts, keys: list, workers: int | None) -> None:
    """Trace and cost `keys` (the whole batch's first) into `costs`, on the cores this
    process may use (the module docstring says who exports what).  Microbatch sizes are
    dealt by `deal`; the whole batch's stays here, the exported size's with the process
    that exported it.  With one worker or one size: the whole batch traced, the search's
    loop costs the keys in turn."""
    groups = groups_of(keys)
    lanes = min(worker_count(workers), len(groups))
    whole = (costs.model, costs.example_inputs, costs.example_kwargs or {}, costs.mixed_precision)
    if lanes < 2:
        planning_trace(*whole)
        return
    batch = keys[0][1]
    size = max(s for s in groups if s != batch)
    shares = deal(groups, lanes, {0: groups[batch], 1: groups[size]})

    def here(peers) -> Costed:
        start = time.perf_counter()
        mine = pickle.dumps(TRACES.exported_outlines(planning_trace(*whole)))
        for peer in peers:
            peer.send(mine)
        if len(peers) > 1:   # (the processes beyond the first need its outline now)
            theirs = peers[0].recv()
            for peer in peers[1:]:
                peer.send(theirs)
        got = costs.share(shares[0][:1])   # (the whole batch needs nothing from the others)
        if len(peers) == 1:
            theirs = peers[0].recv()
        if theirs is not None:
            TRACES.adopt_outlines(pickle.loads(theirs))
        got.update(costs.share(shares[0][1:]))
        return Costed(0, got, time.perf_counter() - start)

    def there(k, peer) -> Costed:
        start = time.perf_counter()
        if k == 1:
            try:
                rows = first_microbatch((tuple(costs.example_inputs), costs.example_kwargs), batch, size)
                traced = planning_trace(costs.model, *rows, costs.mixed_precision)
                peer.send(pickle.dumps(TRACES.exported_outlines(traced)))
            except Exception:   # (costed below, where the error is raised again and reported)
                peer.send(None)
            got = costs.share(shares[1][:1], keep=False)   # (its own size needs nothing from the others)
            found = [peer.recv()]
        else:
            got, found = {}, [peer.recv(), peer.recv()]
        for outlines in found:
            if outlines is not None:
                TRACES.adopt_outlines(pickle.loads(outlines))
        got.update(costs.share(shares[k][1:] if k == 1 else shares[k], keep=False))
        return Costed(k, got, time.perf_counter() - start)

    start = time.perf_counter()
    for costed in forked_lanes(here, there, lanes):
        costs.adopt(costed.costs)   # (this process's share is cached already)
        log.debug("pipeline search: %s", costed)
    log.info("pipeline search: the whole batch and %d other microbatch sizes traced and %d candidate "
             "sub-problems costed by this process and %d workers in %.1fs", len(groups) - 1, len(keys),
             lanes - 1, time.perf_counter() - start)


def cost_in_parallel(costs: StageCosts, keys: list, workers: int | None) -> None:
    """Cost `keys` into `costs` in forked processes, once this process has the traces every
    size is written from: groups of one microbatch size dealt by `deal`.  This process
    keeps the problems of its own share.  Nothing here (the search's loop costs them in
    turn) with one worker or one group."""
    groups = groups_of(keys)
    lanes = min(worker_count(workers), len(groups))
    if lanes < 2:
        return
    start = time.perf_counter()
    shares = deal(groups, lanes, {})

    def cost(lane) -> Costed:
        began = time.perf_counter()
        return Costed(lane, costs.share(shares[lane], keep=lane == 0), time.perf_counter() - began)

    for costed in forked_map(cost, range(lanes), lanes):
        costs.adopt(costed.costs)   # (this process's share is cached already)
    log.info("pipeline search: %d candidate sub-problems costed by this process and %d workers in %.1fs",
             len(keys), lanes - 1, time.perf_counter() - start)
