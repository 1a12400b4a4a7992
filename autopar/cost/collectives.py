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
A device lists the algorithms its library runs (DeviceSpec.algorithms): NCCL's ring and
tree on GPUs, the ring on gloo.
"""
from __future__ import annotations

import math

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
