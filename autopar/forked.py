"""Independent pieces of planning on the cores this process may use: forked processes
inherit the traced graph, the costs and any closure (nothing is pickled but an item's
position and its result), so the pipeline search's candidates and the recompute
assignments' ILPs run side by side.  The results come back in the items' order and do not
depend on how many processes computed them: the callers merge them in that order.
"""
from __future__ import annotations

import multiprocessing
import os
import sys

_TASK: tuple = ()   # (function, items) of the map in progress, set in the parent before the fork


def worker_count(workers: int | None = None) -> int:
    """Processes to plan with: `workers`, else $AUTOPAR_WORKERS, else the cores this process
    may use; 1 inside a forked worker (it may not fork again) and where fork is missing."""
    if multiprocessing.current_process().daemon or not sys.platform.startswith("linux"):
        return 1
    if workers is None:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        workers = int(os.environ.get("AUTOPAR_WORKERS", "0")) or cores
    return max(1, int(workers))


def forked_map(fn, items, workers: int) -> list:
    """[fn(x) for x in items], with up to `workers` processes: this one computes every
    workers-th item (so what fn keeps in this process's memory stays for those) while
    forked ones compute the rest.  An exception in a worker is raised here."""
    items = list(items)
    lanes = min(worker_count(workers), len(items))
    if lanes < 2:
        return [fn(x) for x in items]
    global _TASK
    _TASK = (fn, items)
    try:
        with multiprocessing.get_context("fork").Pool(lanes - 1) as pool:
            pending = {k: pool.apply_async(_run, (k,)) for k in range(len(items)) if k % lanes}
            out = {k: fn(items[k]) for k in range(0, len(items), lanes)}
            out.update({k: got.get() for k, got in pending.items()})
    finally:
        _TASK = ()
    return [out[k] for k in range(len(items))]


def _run(k: int):
    fn, items = _TASK
    return fn(items[k])
