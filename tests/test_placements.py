"""A layout's facts, written once (autopar/placements.py), give the numbers each stage
relied on: local shapes (even, floor, ceil), gradient targets, the text form's round trip."""
import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import placements as P


def test_local_shapes():
    layout, mesh = (Shard(0), Shard(1)), (4, 2)
    assert P.local_shape((8, 6, 3), layout, mesh) == (2, 3, 3)
    assert P.local_shape_even((8, 6, 3), layout, mesh) == (2, 3, 3)
    assert P.local_shape((10,), (Shard(0), Shard(0)), (2, 2)) == (2,)          # floor: 10 // 2 // 2
    assert P.local_shape_ceil((10,), (Shard(0), Shard(0)), (2, 2)) == (3,)     # the largest rank's piece
    assert P.local_numel((10, 4), (Shard(0), Replicate()), (4, 2)) == 10.0     # 40 / 4
    assert P.local_shape((), (Shard(0),), (4,)) == ()                            # a scalar is whole
    with pytest.raises(ValueError, match=r"dim 0 of shape \(10, 4\) does not divide by 4"):
        P.local_shape_even((10, 4), (Shard(0),), (4,))


def test_gradient_targets_and_local_shape_equality():
    assert P.grad_targets((Partial(), Shard(1), Replicate())) == (Replicate(), Shard(1), Replicate())
    assert P.same_local_shape((Partial(), Shard(0)), (Replicate(), Shard(0)))
    assert not P.same_local_shape((Shard(1),), (Shard(0),))


def test_text_form_round_trips_and_names_bad_input():
    layout = (Shard(2), Replicate(), Partial())
    assert P.show_placements(layout) == "(S(2), R, P)"
    assert tuple(P.placement_from_str(P.placement_str(p)) for p in layout) == layout
    with pytest.raises(ValueError, match="write S"):
        P.placement_from_str("Shard(0)")
    with pytest.raises(TypeError):
        P.placement_str("R")
