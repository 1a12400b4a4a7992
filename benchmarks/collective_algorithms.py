"""Which collective algorithm and protocol the cost model assumes, by message size and
cluster (autopar.cost.nccl on the GPU presets; docs/COLLECTIVES.md, "The NCCL model").

For each call: the (algorithm, protocol) NCCL's tuner would pick, the time, and the bus
bandwidth as nccl-tests reports it (all-reduce: 2(n-1)/n m / t; all-gather: (n-1)/n m / t).
Baseline named in the output: the alpha-beta model priced before (one bandwidth per axis,
the ring or the tree), and the ratio old time / new time.

    python benchmarks/collective_algorithms.py
"""
from __future__ import annotations

import dataclasses

import autopar
from autopar.cost.collective_prices import collective_choice
from autopar.cost.prices import collective_time
from autopar.mesh import PRESETS

SIZES = (("8 B", 8), ("64 KB", 64e3), ("1 MB", 1e6), ("16 MB", 16e6), ("256 MB", 256e6), ("8 GB", 8e9))
CLUSTERS = (("8 H100, one node", (8,), ("tp",), "h100", 0),
            ("64 H100, dp (8 per node)", (64,), ("dp",), "h100", 0),
            ("64 H100, dp outside tp=8", (8, 8), ("dp", "tp"), "h100", 0),
            ("16 A100, 2 DGX nodes", (16,), ("dp",), "a100", 0),
            ("1024 H100, dp (8 per node)", (1024,), ("dp",), "h100", 0))


def main() -> None:
    print(f"{'cluster':28s} {'call':10s} {'size':>7s}  {'algorithm':12s} {'time':>11s} {'busbw':>8s}   "
          f"{'old time':>11s} {'old busbw':>9s}  old/new")
    for label, shape, names, device, axis in CLUSTERS:
        mesh = autopar.Mesh(shape, names, device=device)
        # the same device listing ("tree", "ring"), not autopar.mesh.NCCL: priced by the old alpha-beta model
        old = autopar.Mesh(shape, names, device=dataclasses.replace(PRESETS[device], algorithms=("tree", "ring")))
        n = shape[axis]
        for kind, factor in (("all_reduce", 2 * (n - 1) / n), ("all_gather", (n - 1) / n)):
            for size_label, nbytes in SIZES:
                algorithm, took = collective_choice(kind, nbytes, axis, mesh)
                before = collective_time(kind, nbytes, axis, old)
                print(f"{label:28s} {kind:10s} {size_label:>7s}  {algorithm:12s} {took * 1e6:9.1f}us "
                      f"{factor * nbytes / took / 1e9:7.1f}G   {before * 1e6:9.1f}us {factor * nbytes / before / 1e9:8.1f}G"
                      f"  {before / took:6.2f}x")


if __name__ == "__main__":
    main()
