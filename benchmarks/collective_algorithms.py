"""Which collective algorithm the cost model assumes for a data-parallel gradient
all-reduce, by message size and cluster (autopar.cost.collectives; docs/COLLECTIVES.md).

Baseline named in the output: the ring, the only algorithm priced before; the ratio is
ring time / chosen time (1.00 where the ring is the choice).

    python benchmarks/collective_algorithms.py
"""
from __future__ import annotations

import dataclasses

from torch.distributed.tensor import Partial, Replicate

import autopar
from autopar.cost.prices import redistribute
from autopar.mesh import PRESETS

SIZES = (("1 MB", 1e6), ("100 MB", 1e8), ("1 GB", 1e9))
CLUSTERS = (("8 H100 (one node, NVLink)", (8,), ("gpu",)),
            ("1024 H100 (128 nodes x 8)", (128, 8), ("node", "gpu")))


def main() -> None:
    ring = dataclasses.replace(PRESETS["h100"], algorithms=("ring",))
    print("gradient all-reduce (Partial -> Replicate over every axis), h100 preset, NCCL's ring and tree")
    print(f"{'cluster':28s} {'size':>7s}  {'algorithm':10s} {'time':>10s} {'ring time':>10s}  ring / chosen")
    for label, shape, names in CLUSTERS:
        mesh = autopar.Mesh(shape, names, device="h100")
        only_ring = autopar.Mesh(shape, names, device=ring)
        placements = (Partial(),) * len(shape), (Replicate(),) * len(shape)
        for size_label, nbytes in SIZES:
            steps = redistribute((int(nbytes),), 1, *placements, mesh)
            base = sum(s.seconds for s in redistribute((int(nbytes),), 1, *placements, only_ring))
            took = sum(s.seconds for s in steps)
            algs = "/".join(sorted({s.algorithm for s in steps}))
            print(f"{label:28s} {size_label:>7s}  {algs:10s} {took * 1e3:8.3f}ms {base * 1e3:8.3f}ms  {base / took:.2f}x")


if __name__ == "__main__":
    main()
