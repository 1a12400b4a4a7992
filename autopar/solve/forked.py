"""Independent pieces of planning on the cores this process may use: forked processes
inherit the traced graph, the costs and any closure (nothing is pickled but an item's
position and its result), so the pipeline search's candidates and the recompute
assignments' ILPs run side by side.  The results come back in the items' order and do not
depend on how many processes computed them: the callers merge them in that order.
forked_lanes adds a pipe between each forked process and this one, for work that trades
values while it runs (the pipeline search's traces: each process exports one batch size
and sends the other its outline).  A forked process dies with the one that forked it
(_die_with_parent), so a planner killed for memory or by hand leaves nothing running.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import sys
import threading

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
        with multiprocessing.get_context("fork").Pool(lanes - 1, _die_with_parent, (os.getpid(),)) as pool:
            pending = {k: pool.apply_async(_run, (k,)) for k in range(len(items)) if k % lanes}
            out = {k: fn(items[k]) for k in range(0, len(items), lanes)}
            out.update({k: got.get() for k, got in pending.items()})
    finally:
        _TASK = ()
    return [out[k] for k in range(len(items))]


def _die_with_parent(parent: int) -> None:
    """Run first in every forked planning process: it is killed when the process that forked
    it ends (Linux's parent-death signal), so a planner killed for memory or by hand leaves
    no worker computing on; and it exits at once if that process is gone already."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):   # (no prctl: the worker may outlive a killed parent)
        pass
    if os.getppid() != parent:
        os._exit(1)


def _run(k: int):
    fn, items = _TASK
    return fn(items[k])


def forked_lanes(here, there, lanes: int) -> list:
    """here(peers) in this process and there(k, peer) in lanes - 1 forked processes
    (k = 1, 2, ...), all at once, each forked one joined to this one by a pipe: a Peer,
    whose send and recv carry picklable values both ways while they work (peers: this
    process's ends, by k - 1).  Returns [here's result, there(1)'s, ...].  An exception in
    a forked process is raised here, at the next recv from it or at the end; one here stops
    the forked processes."""
    ctx = multiprocessing.get_context("fork")
    procs, peers = [], []
    done = False
    try:
        for k in range(1, lanes):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_lane, args=(there, k, theirs, os.getpid()), daemon=True)
            proc.start()
            theirs.close()
            procs.append(proc)
            peers.append(Peer(mine))
        out = [here(peers)]
        out.extend(peer.recv() for peer in peers)
        done = True
        return out
    finally:
        for proc in procs:
            if not done:
                proc.terminate()
            proc.join()
        for peer in peers:
            peer.flush()


class Peer:
    """One end of a forked_lanes pipe.  send does not wait for the other end to read (a
    thread writes), so two ends may send to each other at once."""

    def __init__(self, conn):
        self.conn = conn
        self.sending = None

    def send(self, value, kind: str = "value") -> None:
        self.flush()   # (in order)
        self.sending = threading.Thread(target=self._write, args=((kind, value),), daemon=True)
        self.sending.start()

    def _write(self, message) -> None:
        try:
            self.conn.send(message)
        except OSError:   # (the other end stopped: its error, or this one's, is what is raised)
            pass
        except Exception as exc:   # (not picklable)
            self.conn.send(("error", RuntimeError(f"a forked planning process could not send its "
                                                  f"{type(message[1]).__name__}: {exc}")))

    def flush(self) -> None:
        """Wait until what was sent is written."""
        if self.sending is not None:
            self.sending.join()
            self.sending = None

    def recv(self):
        """The next value the other end sent; its exception, if it raised instead."""
        try:
            kind, value = self.conn.recv()
        except EOFError:
            raise RuntimeError("a forked planning process ended without an answer (killed, or out of memory?)") \
                from None
        if kind == "error":
            raise value
        return value


def _lane(there, k, conn, parent: int) -> None:
    _die_with_parent(parent)
    peer = Peer(conn)
    try:
        result = there(k, peer)
        peer.send(result)
    except BaseException as exc:   # (raised in the process that forked this one)
        try:
            pickle.dumps(exc)
        except Exception:
            exc = RuntimeError(f"{type(exc).__name__}: {exc}")
        peer.send(exc, "error")
    peer.flush()
