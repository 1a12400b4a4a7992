"""Collective algorithms: the alpha-beta time of one collective call under each algorithm a
communication library may run, and the choice of the cheapest (docs/COLLECTIVES.md
derives each formula).

One call on n ranks of one mesh axis; m is the bytes the call reads (an all-gather's
output, any other collective's input), B the axis's bandwidth per rank in one direction,
a its latency per step, L the fixed cost of a call (launch and synchronisation):

    algorithm          all-reduce                        all-gather / reduce-scatter
    ring               L + 2(n-1) a + 2(n-1)/n m/B       L + (n-1) a + (n-1)/n m/B
    tree               L + 2 ceil(log2 n) a + 2 m/B      (as ring)
    halving-doubling   L + 2 ceil(log2 n) a + 2(n-1)/n m/B   L + ceil(log2 n) a + (n-1)/n m/B
    parameter-server   L + 2 a + 2(n-1) m/B              (as ring)

All-to-all is pairwise exchange under every algorithm: L + (n-1) a + (n-1)/n m/B.

"tree" is the double binary tree (a reduce up and a broadcast down two complementary trees,
each carrying half the data, pipelined): logarithmic latency at about the ring's bandwidth.
"halving-doubling" is recursive halving for the reduce-scatter and recursive doubling for
the all-gather (Rabenseifner's all-reduce); with n not a power of two it pays one more
exchange of the whole message before and after.  "parameter-server" sends every gradient
to one rank and the sum back: the server's link carries n - 1 copies each way, which is
why no preset offers it; it is here to be compared.

Each is a line in m (fixed seconds + seconds per byte), so a redistribution table priced
once per pair of layouts (cost.redistribute_price) keeps one line per algorithm and takes
the cheapest at each tensor's size, as a communication library's tuner picks per call.
A device lists the algorithms its library runs (DeviceSpec.algorithms): the ring on gloo,
priced here; NCCL on the GPU presets (autopar.mesh.NCCL), priced by autopar.cost.nccl with
its protocols and the group's placement on nodes.  `Line` is one such priced line,
`cheapest` keeps the lines that win at some size, and `combine` turns the steps of one
redistribution into a few lines of the whole move (`columns` of them per device).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from autopar.mesh import NCCL

ALGORITHMS = ("ring", "tree", "halving-doubling", "parameter-server")
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def line(kind: str, algorithm: str, n: int, bandwidth: float, latency: float, launch: float) -> tuple:
    """(fixed seconds, seconds per byte of m) of one `kind` call on n ranks under `algorithm`."""
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; one of {KINDS}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"unknown collective algorithm {algorithm!r}; one of {ALGORITHMS}")
    if n <= 1:
        return 0.0, 0.0
    frac = (n - 1) / n
    steps = math.ceil(math.log2(n))
    uneven = n & (n - 1) != 0   # not a power of two
    if kind == "all_to_all":
        return launch + (n - 1) * latency, frac / bandwidth
    if kind == "all_reduce":
        if algorithm == "tree":
            return launch + 2 * steps * latency, 2 / bandwidth
        if algorithm == "halving-doubling":
            extra = (2 * latency, 2 / bandwidth) if uneven else (0.0, 0.0)
            return launch + 2 * steps * latency + extra[0], 2 * frac / bandwidth + extra[1]
        if algorithm == "parameter-server":
            return launch + 2 * latency, 2 * (n - 1) / bandwidth
        return launch + 2 * (n - 1) * latency, 2 * frac / bandwidth
    if algorithm == "halving-doubling":
        extra = (latency, 1 / bandwidth) if uneven else (0.0, 0.0)
        return launch + steps * latency + extra[0], frac / bandwidth + extra[1]
    return launch + (n - 1) * latency, frac / bandwidth


def seconds(kind: str, algorithm: str, nbytes: float, n: int, bandwidth: float, latency: float,
            launch: float) -> float:
    """Seconds of one call of `nbytes` (see the module docstring for which bytes)."""
    if n <= 1 or nbytes == 0:
        return 0.0
    fixed, per_byte = line(kind, algorithm, n, bandwidth, latency, launch)
    return fixed + per_byte * nbytes


def choose(kind: str, nbytes: float, n: int, bandwidth: float, latency: float, launch: float,
           algorithms=("ring",)) -> tuple:
    """(algorithm, seconds) of the cheapest of `algorithms` for this call (ties: the first)."""
    best = None
    for algorithm in algorithms:
        t = seconds(kind, algorithm, nbytes, n, bandwidth, latency, launch)
        if best is None or t < best[1]:
            best = (algorithm, t)
    return best


@dataclass(frozen=True)
class Line:
    """One way to run a call: `algorithm` (its name as the plan records it: "ring", or
    "ring/LL128" under NCCL) at `fixed` seconds plus `per_byte` seconds per byte."""

    algorithm: str
    fixed: float
    per_byte: float

    def seconds(self, nbytes: float) -> float:
        return self.fixed + self.per_byte * nbytes

    def scaled(self, share: float) -> "Line":
        """The same call priced per byte of a tensor of which it reads `share`."""
        return Line(self.algorithm, self.fixed, self.per_byte * share)

    def __str__(self) -> str:
        return f"{self.algorithm}: {self.fixed * 1e6:.1f} us + m / {1 / self.per_byte / 1e9 if self.per_byte else float('inf'):.1f} GB/s"


def cheapest(lines) -> tuple:
    """The lines that are the cheapest at some size m > 0, from small m to large (each has a
    smaller per_byte and a larger fixed cost than the one before): NCCL's tuner choice at
    every size is one of them, and the others can be dropped."""
    lines = tuple(lines)
    if not lines:
        raise ValueError("cheapest() needs at least one line")
    current = min(lines, key=lambda ln: (ln.fixed, ln.per_byte))
    out, at = [current], 0.0
    while True:
        crossings = [((ln.fixed - current.fixed) / (current.per_byte - ln.per_byte), ln.per_byte, i)
                     for i, ln in enumerate(lines) if ln.per_byte < current.per_byte]
        crossings = [c for c in crossings if c[0] >= at]
        if not crossings:
            return tuple(out)
        at, _, i = min(crossings)
        current = lines[i]
        out.append(current)


def breakpoints(lines: tuple) -> list:
    """The sizes at which `cheapest(lines)` (in that order) hands over from one line to the next."""
    return [(a.fixed - b.fixed) / (b.per_byte - a.per_byte) for a, b in zip(lines, lines[1:])]


def combine(steps: list, width: int) -> list:
    """The cheapest way to run every step of one move, as `width` columns of one Line per
    step: each step's cheapest lines (`cheapest`, in the move's bytes) change at a few sizes;
    between two such sizes the cheapest choice of every step is fixed, so the move's time
    is the least of a few straight lines, one per such stretch.  Columns beyond the
    stretches repeat the last.  Where there are more stretches than `width`, the columns
    kept are chosen one drop at a time, each time dropping the one whose loss overprices
    the move least at the sizes of TRIM_SIZES (relative to the exact least).  Remembered
    per steps and width: a 3-axis problem's 36,000 layout pairs ask for some 500 distinct
    ones (half of building the 405B-shaped Llama's stage problems)."""
    return list(_combined(tuple(tuple(s) for s in steps), width))


@functools.lru_cache(maxsize=1 << 14)
def _combined(steps: tuple, width: int) -> tuple:
    fronts = [cheapest(s) for s in steps]
    cuts = sorted({x for f in fronts for x in breakpoints(f) if x > 0})
    probes = ([cuts[0] / 2] + [math.sqrt(a * b) for a, b in zip(cuts, cuts[1:])] + [cuts[-1] * 2]) if cuts else [1.0]
    columns = [tuple(min(f, key=lambda ln: ln.seconds(x)) for f in fronts) for x in probes]
    if len(columns) > width:
        times = [[sum(ln.seconds(x) for ln in col) for x in TRIM_SIZES] for col in columns]
        exact = [min(t[i] for t in times) for i in range(len(TRIM_SIZES))]
        keep = list(range(len(columns)))
        while len(keep) > width:
            def worst(without):
                rest = [times[c] for c in keep if c != without]
                return max(min(t[i] for t in rest) / exact[i] for i in range(len(exact)))
            keep.remove(min(keep, key=worst))
        columns = [columns[c] for c in keep]
    return tuple(columns + [columns[-1]] * (width - len(columns)))


TRIM_SIZES = tuple(2.0 ** e for e in range(6, 37, 2))   # 64 B to 64 GiB: the tensors a move may carry


def columns(device) -> int:
    """How many priced lines a redistribution table keeps per layout pair on `device`: one per
    algorithm for a library priced here; NCCL_COLUMNS cheapest-at-some-size lines for NCCL."""
    return NCCL_COLUMNS if device.algorithms == NCCL else len(device.algorithms)


NCCL_COLUMNS = 4
