"""The numerics tests' tolerance bands (tests/rt_cases.py) admit round-off and nothing more:
a reordered float32 sum is inside, a gradient that lost a rank's share or a parameter that
missed one AdamW update is far outside."""
import math

import torch

from rt_cases import EPS, excess, reduction_band, reduction_size, update_band


def test_reordered_sums_are_inside_and_a_lost_share_is_outside():
    torch.manual_seed(0)
    terms = torch.randn(8192, 32) * 0.01          # 8,192 terms per entry, as 64 tokens x 128 wide
    whole = terms.sum(0)
    by_rank = sum(part.sum(0) for part in terms.chunk(4))   # four ranks' partial sums, added in rank order
    band = reduction_band(whole, 8192)
    assert band == math.sqrt(8192) * EPS * float(whole.abs().max())
    assert excess(by_rank, whole, band) <= 0
    lost = sum(part.sum(0) for part in terms.chunk(4)[:3])   # one rank's share missing
    assert excess(lost, whole, band) > 100 * band


def test_one_missed_update_is_outside_the_update_band():
    steps, lr = 3, 1e-4
    band = update_band(steps, "adamw")
    assert band == steps * lr / 100 and update_band(steps, "sgd") == 0.0
    p = torch.full((16,), 0.05)
    assert excess(p - lr, p, band) > 0        # an update of about lr that did not happen


def test_reduction_size_counts_tokens_times_the_widest_weight():
    model = torch.nn.Sequential(torch.nn.Embedding(128, 64), torch.nn.Linear(64, 256))
    ids = torch.zeros(4, 16, dtype=torch.long)
    assert reduction_size(model, (ids,), {}) == 4 * 16 * 256
    assert reduction_size(model, (torch.zeros(4, 16, 64),), {}) == 4 * 16 * 256
