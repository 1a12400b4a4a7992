"""The ZeRO memory table (80 GB devices, N = 64, mixed-precision Adam)."""
import pytest

from autopar.cost.memory import max_trainable_params, state_bytes_per_param


@pytest.mark.parametrize("stage,billions", [(0, 5.0), (1, 19.0), (2, 36.0), (3, 320.0)])
def test_zero_table(stage, billions):
    got = max_trainable_params(80e9, 64, stage)
    assert got == pytest.approx(billions * 1e9, rel=0.01)


def test_bytes_per_parameter_by_stage():
    assert state_bytes_per_param(64, 0) == 16
    assert state_bytes_per_param(64, 1) == 2 + 2 + 12 / 64
    assert state_bytes_per_param(64, 2) == 2 + 14 / 64
    assert state_bytes_per_param(64, 3) == 16 / 64
    assert max_trainable_params("80GB", 64, 3) == max_trainable_params(80e9, 64, 3)
    with pytest.raises(ValueError, match="zero_stage"):
        state_bytes_per_param(8, 4)
