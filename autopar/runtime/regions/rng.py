"""Random ops (dropout and any op that draws random numbers) give a valid model on any plan.

The rule.  Every random op of the compiled graph draws from its own stream, seeded from
(the job's seed, the forward call, the op, this rank's coordinates on the mesh axes where
the op's output is split):

- where the output is whole (Replicate) or a partial sum (Partial) on an axis, the ranks
  along that axis draw the same numbers: a replicated tensor gets the same dropout mask on
  every rank that holds it, so replicated weights never drift apart, and a mask applied to
  a partial sum is the same in every term, so the sum is masked as a whole;
- where the output is split (Shard) on an axis, each rank's piece draws its own numbers:
  different batch rows, sequence positions or hidden units get independent masks.

The job's seed is rank 0's: `compile(seed=...)` if given, else rank 0's
`torch.initial_seed()` (what `torch.manual_seed` set there), handed to every rank at
compile.  So seeding each rank differently (`torch.manual_seed(base + rank)`, a DDP
habit) changes nothing of the above, and a fixed seed on rank 0 makes two runs of the same
plan bit-identical.  Masks are not those of the plain model on one device (that would
need every rank to draw the whole tensor's mask); their distribution is.

Mechanism: the pass autopar/passes/random_ops.py routes each random op through the graph's
streams slot, numbered over the whole graph; this module's RandomStreams is what the
runtime binds there.  Each random call runs with the device's default generator set to the stream's
seed and restored afterwards, so the op itself (aten.dropout, aten.bernoulli, ...) runs
unchanged and the user's own random state is untouched.
"""
from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1


def _mix(x: int) -> int:
    """splitmix64's finaliser: a well-spread 64-bit value from x."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class RandomStreams:
    """The streams of one compiled module (see the module docstring).  `calls` counts the
    forward calls of its graphs (each pipeline stage's call of a microbatch is one)."""

    def __init__(self, seed: int, groups, device: torch.device, sites: tuple = ()):
        """sites: the graph's RandomSites (autopar/passes/random_ops.route_random), in site order."""
        self.seed = int(seed)
        self.groups = groups
        self.device = device
        self.calls = 0
        self.sites: list = []   # k -> (op, this rank's stream key on the op's split axes)
        for site in sites:
            key = 0
            for a in site.split:
                key = _mix(key ^ _mix((a << 32) | groups.coordinate(a)))
            self.sites.append((site.op, key))

    def seed_of(self, k: int) -> int:
        _, key = self.sites[k]
        return _mix(_mix(_mix(self.seed) ^ self.calls) ^ _mix(k) ^ key) & ((1 << 63) - 1)

    def draw(self, *args, _autopar_site: int, **kwargs):
        op, _ = self.sites[_autopar_site]
        generator = (torch.cuda.default_generators[self.device.index or 0] if self.device.type == "cuda"
                     else torch.default_generator)
        state = generator.get_state()
        generator.manual_seed(self.seed_of(_autopar_site))
        try:
            return op(*args, **kwargs)
        finally:
            generator.set_state(state)
