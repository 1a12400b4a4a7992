"""The disk tier: tensors kept in files between uses (optimizer states offloaded to NVMe).

A `DiskStore` is one rank's directory, made under the job's `offload_dir` when the model
is compiled and removed when the store is closed or the process ends.  It holds named
tensors as raw files.  `spill` writes tensors out and then frees their memory (each
tensor object keeps its identity, shape and dtype: the optimizer's state dict and the
rank's masters still point at it, it only holds no storage); `fetch` reads them back
into fresh storage.  Both run on one background thread, in the order they were asked
for, so a caller can read the next group while it computes on this one (the sharded
optimizer reads its next run of parameters so).  A
write that fails (a full disk) leaves its tensors in memory and raises `OffloadError`
at the next wait: nothing trained is lost.

`check_directory` is compile's check: the directory can be made and written, and has
room for what this machine's ranks will keep there.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from autopar.runtime.process import CompileError


# The environment variable compile's offload_dir defaults to.
OFFLOAD_DIR_ENV = "AUTOPAR_OFFLOAD_DIR"


class OffloadError(RuntimeError):
    """The disk tier could not be written or read; the message names the file and the cause."""


def _raw(t: torch.Tensor):
    """A writable byte view of contiguous CPU tensor `t`'s storage."""
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


def check_directory(directory, need: float, local_ranks: int) -> Path:
    """`directory` made if missing, written to once, with room for `need` bytes from each
    of `local_ranks` ranks; CompileError saying what to change otherwise."""
    if directory is None:
        raise CompileError(f"the plan keeps optimizer states on disk ({need / 2**30:.2f} GiB on this rank): pass "
                           f"autopar.compile(..., run=autopar.RunOptions(offload_dir=...)) naming a directory on a "
                           f"local disk (NVMe) (or set {OFFLOAD_DIR_ENV}), or plan without the disk tier (a larger memory_budget, "
                           f"or more devices)")
    path = Path(directory).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path) as f:
            f.write(b"autopar")
    except OSError as exc:
        raise CompileError(f"offload_dir {str(path)!r} cannot be written ({exc.strerror or exc}); pass a directory "
                           f"this job may create files in") from None
    free = shutil.disk_usage(path).free
    if need * local_ranks > free:
        raise CompileError(f"offload_dir {str(path)!r} has {free / 2**30:.2f} GiB free; the {local_ranks} ranks on "
                           f"this machine keep {need * local_ranks / 2**30:.2f} GiB of optimizer states there "
                           f"({need / 2**30:.2f} GiB each). Free space, point offload_dir at a larger disk, or "
                           f"plan with less on disk (a larger memory_budget, or more devices)")
    return path


class DiskStore:
    """One rank's files under the offload directory (see the module docstring)."""

    def __init__(self, directory: Path, rank: int):
        self.directory = Path(tempfile.mkdtemp(prefix=f"autopar-rank{rank}-", dir=directory))
        self.sizes: dict = {}           # file name -> bytes written
        self.shapes: dict = {}          # file name -> shape of the tensor written
        self.spilled: set = set()       # names whose tensors hold no storage now
        self.mapped_names: set = set()  # names mapped as tensors (offloaded weights)
        self.read_bytes = self.written_bytes = 0
        self.read_s = self.written_s = 0.0
        self._io = ThreadPoolExecutor(1, thread_name_prefix="autopar-disk")
        self._lock = threading.Lock()
        self._closer = weakref.finalize(self, _remove, self._io, str(self.directory))

    def __repr__(self) -> str:
        return f"DiskStore({str(self.directory)!r}, {len(self.sizes)} files, {self.disk_bytes / 2**20:.1f} MiB)"

    @property
    def disk_bytes(self) -> int:
        return sum(self.sizes.values())

    def path(self, name: str) -> Path:
        return self.directory / name

    def spill(self, items) -> Future:
        """Write each (name, tensor) of `items` to its file, then free the tensor's storage."""
        items = list(items)
        return self._io.submit(self._spill, items)

    def fetch(self, items) -> Future:
        """Read each (name, tensor) of `items` back into fresh storage of its shape (a
        tensor already in memory is left as it is)."""
        items = list(items)
        return self._io.submit(self._fetch, items)

    @contextlib.contextmanager
    def resident(self, items, write_back: bool = True):
        """The (name, tensor) pairs `items()` gives in memory inside the block, spilled
        after it: written back where write_back, with any the block made (items() is asked
        again), else only freed (a block that only reads them)."""
        fetched = [(n, t) for n, t in items() if n in self.spilled]
        wait(self.fetch(fetched))
        try:
            yield
        finally:
            if write_back:
                wait(self.spill(items()))
            else:
                for name, t in fetched:
                    self._free(name, t)

    def read(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """A new tensor of `like`'s dtype, shaped as `name` was written, read from its file
        (the store left as it is)."""
        out = torch.empty(self.shapes[name], dtype=like.dtype)
        self._read_into(name, out)
        return out

    def mapped(self, name: str, like: torch.Tensor) -> torch.Tensor:
        """`name`'s file as a tensor shaped as it was written, mapped read-only from the
        file (pages read as they are touched: a checkpoint copies it without first
        holding it in memory)."""
        shape = self.shapes[name]
        numel = 1
        for n in shape:
            numel *= n
        return torch.from_file(str(self.path(name)), shared=False, size=numel, dtype=like.dtype).view(shape)

    def mapping(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """`value` written to file `name` and returned as a shared, writable mapping of it:
        what is written to the tensor goes to the file, and the operating system keeps in
        memory what fits of it (the disk tier of offloaded weights; `advise` asks for a
        tensor's pages ahead of use)."""
        value = value.detach().contiguous().cpu()
        self._write(name, value, "free space on the offload disk or plan with less on disk")
        self.mapped_names.add(name)
        return torch.from_file(str(self.path(name)), shared=True, size=value.numel(),
                               dtype=value.dtype).view(value.shape)

    def advise(self, name: str) -> None:
        """Ask the operating system to read file `name` ahead (a mapped tensor about to be
        used); a hint, done on the I/O thread."""
        if name in self.mapped_names and hasattr(os, "posix_fadvise"):
            self._io.submit(_will_need, str(self.path(name)))

    def close(self) -> None:
        """Remove the directory and its files (also done when the process ends)."""
        self._closer()

    # --- on the I/O thread ---------------------------------------------------------------------
    def _spill(self, items) -> None:
        for name, t in items:
            if name in self.spilled:
                continue
            if t.device.type != "cpu" or not t.is_contiguous():
                raise OffloadError(f"{name}: only contiguous host tensors go to disk (got {t.device}, "
                                   f"contiguous={t.is_contiguous()})")
            self._write(name, t, "the tensor stays in host memory; free space on the offload disk or save a "
                                 "checkpoint now")
            self._free(name, t)

    def _write(self, name: str, t: torch.Tensor, fix: str) -> None:
        """Contiguous host tensor `t` written to file `name`; OffloadError naming the file,
        the cause and `fix` where it cannot be."""
        start = time.perf_counter()
        nbytes = t.numel() * t.element_size()
        try:
            with open(self.path(name), "wb") as f:
                f.write(_raw(t))
        except OSError as exc:
            raise OffloadError(f"writing {name} ({nbytes / 2**20:.1f} MiB) to {self.path(name)} failed: "
                               f"{exc.strerror or exc}; {fix}") from None
        with self._lock:
            self.written_s += time.perf_counter() - start
            self.written_bytes += nbytes
            self.sizes[name] = nbytes
            self.shapes[name] = tuple(t.shape)

    def _free(self, name, t) -> None:
        t.data = torch.empty(0, dtype=t.dtype)
        self.spilled.add(name)

    def _fetch(self, items) -> None:
        for name, t in items:
            if name not in self.spilled:
                continue
            buf = torch.empty(self.shapes[name], dtype=t.dtype)
            self._read_into(name, buf)
            t.data = buf
            self.spilled.discard(name)

    def _read_into(self, name, out: torch.Tensor) -> None:
        start = time.perf_counter()
        want = out.numel() * out.element_size()
        try:
            with open(self.path(name), "rb") as f:
                got = f.readinto(_raw(out))
        except OSError as exc:
            raise OffloadError(f"reading {name} from {self.path(name)} failed: {exc.strerror or exc}") from None
        if got != want:
            raise OffloadError(f"{self.path(name)} holds {got} bytes, {want} expected: the offload directory was "
                               f"changed while the job ran")
        with self._lock:
            self.read_s += time.perf_counter() - start
            self.read_bytes += want


def _will_need(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def wait(future: Future) -> None:
    """The I/O thread's work of `future` done; its error raised here."""
    future.result()


def _remove(io: ThreadPoolExecutor, directory: str) -> None:
    io.shutdown(wait=True)
    shutil.rmtree(directory, ignore_errors=True)
