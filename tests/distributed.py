"""A pool of gloo ranks kept alive across tests, so that no test launches torchrun.

    pool = WorkerPool(4)                  # 4 spawned processes, one gloo process group
    per_rank = pool.run(fn, *args, **kw)  # fn(*args, **kw) on every rank, results in rank order
    pool.close()

`fn` is pickled by reference: it must be a module-level function of an importable module
(a test module or a helper under tests/, which is on the workers' sys.path). Inside a job,
`device_mesh(shape, names)` returns a cached DeviceMesh, so repeated jobs on one shape do
not create new process groups.

An exception on any rank is raised in the parent as `WorkerError` carrying that rank's
traceback. When every rank answers, the pool stays usable; when some rank does not answer
within `grace` seconds of another rank's failure (it is stuck in a collective its peer never
entered), or no rank answers within `timeout` seconds, the pool is killed and the next
`run` starts a fresh one.

This module imports torch only inside the workers' functions, so that a worker can set
OMP_NUM_THREADS before torch is first imported.
"""
from __future__ import annotations

import logging
import multiprocessing as mp
import os
import pickle
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait

log = logging.getLogger("autopar")

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_MESHES: dict = {}


class WorkerError(RuntimeError):
    """A job raised on one or more ranks; `tracebacks` maps rank to its formatted traceback."""

    def __init__(self, fn_name: str, tracebacks: dict[int, str]):
        self.tracebacks = tracebacks
        parts = [f"{fn_name} failed on rank(s) {sorted(tracebacks)}"]
        for rank, tb in sorted(tracebacks.items()):
            parts.append(f"--- rank {rank} ---\n{tb.rstrip()}")
        super().__init__("\n".join(parts))


class PoolTimeout(RuntimeError):
    """Some rank did not answer in time; the pool has been killed."""


def device_mesh(shape: tuple[int, ...], names: tuple[str, ...] | None = None):
    """Inside a worker: `init_device_mesh("cpu", shape, mesh_dim_names=names)`, built once per
    (shape, names). Every rank must ask for meshes in the same order (they run the same job)."""
    from torch.distributed.device_mesh import init_device_mesh

    key = (tuple(shape), None if names is None else tuple(names))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh("cpu", key[0], mesh_dim_names=key[1])
    return _MESHES[key]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker_main(rank: int, world_size: int, port: int, conn, pg_timeout_s: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    if TESTS_DIR not in sys.path:
        sys.path.insert(0, TESTS_DIR)
    try:
        import datetime

        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=datetime.timedelta(seconds=pg_timeout_s))
    except BaseException:
        conn.send(("err", traceback.format_exc()))
        return
    conn.send(("ready", None))
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            break
        try:
            job = pickle.loads(data)  # here, so that an unimportable fn is reported, not fatal
            if job is None:
                break
            fn, args, kwargs = job
            result = ("ok", fn(*args, **kwargs))
        except BaseException:
            result = ("err", traceback.format_exc())
        try:
            conn.send(result)
        except Exception:
            conn.send(("err", f"the result of {fn!r} could not be sent back:\n"
                              + traceback.format_exc()))
    try:
        dist.destroy_process_group()
    except Exception:
        pass


class WorkerPool:
    """`world_size` spawned gloo ranks on 127.0.0.1 that run jobs sent by `run`.

    timeout: seconds `run` waits for all ranks before killing the pool (default 300).
    grace: seconds to wait for the other ranks once one rank has failed.
    """

    def __init__(self, world_size: int, timeout: float = 300.0, grace: float = 10.0,
                 start_timeout: float = 120.0):
        self.world_size = world_size
        self.timeout = timeout
        self.grace = grace
        self.start_timeout = start_timeout
        self._procs: list = []
        self._conns: list = []
        self._start()

    # ---- lifecycle ----

    def _start(self, attempts: int = 3) -> None:
        ctx = mp.get_context("spawn")
        for attempt in range(attempts):
            t0 = time.perf_counter()
            port = _free_port()
            self._procs, self._conns = [], []
            for rank in range(self.world_size):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker_main, name=f"autopar-rank{rank}", daemon=True,
                                args=(rank, self.world_size, port, child, self.timeout))
                p.start()
                child.close()
                self._procs.append(p)
                self._conns.append(parent)
            try:
                self._collect("init_process_group", self.start_timeout)
            except (WorkerError, PoolTimeout) as e:
                self._kill()
                if attempt + 1 == attempts:
                    raise RuntimeError(f"could not start {self.world_size} gloo ranks "
                                       f"after {attempts} attempts") from e
                log.warning("worker pool start failed (port %d), retrying: %s", port, e)
                continue
            log.info("worker pool of %d gloo ranks started in %.1f s",
                     self.world_size, time.perf_counter() - t0)
            return

    @property
    def alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=10)
        for c in self._conns:
            c.close()
        self._procs, self._conns = [], []

    def close(self) -> None:
        """Ask every rank to leave its loop, then make sure they are gone."""
        for c in self._conns:
            try:
                c.send(None)
            except (OSError, BrokenPipeError):
                pass
        for p in self._procs:
            p.join(timeout=10)
        self._kill()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- jobs ----

    def run(self, fn, *args, **kwargs) -> list:
        """Call `fn(*args, **kwargs)` on every rank; return the results in rank order."""
        if not self.alive:
            log.warning("worker pool was dead; starting a fresh one")
            self._kill()
            self._start()
        payload = pickle.dumps((fn, args, kwargs))  # fails here, before any rank starts
        for c in self._conns:
            c.send_bytes(payload)
        return self._collect(getattr(fn, "__qualname__", repr(fn)), self.timeout)

    def _collect(self, what: str, timeout: float) -> list:
        results: dict[int, object] = {}
        errors: dict[int, str] = {}
        pending = {c: r for r, c in enumerate(self._conns)}
        sentinels = {p.sentinel: r for r, p in enumerate(self._procs)}
        deadline = time.monotonic() + timeout
        first_error = 0.0  # when the first rank failed (set with the first error)
        while pending:
            if errors:
                deadline = min(deadline, first_error + self.grace)
            left = deadline - time.monotonic()
            ready = wait(list(pending) + list(sentinels), timeout=max(left, 0)) if left > 0 else []
            if not ready:
                missing = sorted(pending.values())
                self._kill()
                if errors:
                    errors.update({r: f"(no answer within {self.grace:.0f} s of the failure on "
                                      f"another rank; pool killed)" for r in missing})
                    raise WorkerError(what, errors)
                raise PoolTimeout(f"{what}: rank(s) {missing} did not answer within "
                                  f"{timeout:.0f} s; the pool was killed (raise WorkerPool.timeout "
                                  f"for longer jobs)")
            for obj in ready:
                if obj in pending:
                    rank = pending[obj]
                    try:
                        status, value = obj.recv()
                    except (EOFError, OSError):
                        continue  # the process died; its sentinel reports it
                    del pending[obj]
                    if status in ("ok", "ready"):
                        results[rank] = value
                    else:
                        if not errors:
                            first_error = time.monotonic()
                        errors[rank] = value
                elif obj in sentinels:
                    rank = sentinels.pop(obj)
                    conn = self._conns[rank]
                    if conn in pending and not conn.poll():
                        del pending[conn]
                        self._procs[rank].join(timeout=5)
                        code = self._procs[rank].exitcode
                        if not errors:
                            first_error = time.monotonic()
                        errors[rank] = f"worker process exited with code {code}"
        if errors:
            if not self.alive:
                self._kill()
            raise WorkerError(what, errors)
        return [results[r] for r in range(self.world_size)]
