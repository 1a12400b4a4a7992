"""autopar.Mesh and memory sizes reject bad input at the door, naming the argument and the value."""
import math

import numpy as np
import pytest

import autopar
from autopar.devices import GiB
from autopar.mesh import parse_bytes


@pytest.mark.parametrize("shape", ["2x2", (2, 2), [2, 2], " 2 x 2 ", (np.int64(2), np.int32(2))])
def test_spellings_of_a_2x2_mesh_are_equal(shape):
    mesh = autopar.Mesh(shape, ("dp", "tp"))
    assert mesh == autopar.Mesh((2, 2), ("dp", "tp"))
    assert mesh.shape == (2, 2) and all(type(s) is int for s in mesh.shape)


@pytest.mark.parametrize("shape", [4, "4", (4,), [4]])
def test_spellings_of_a_1d_mesh_are_equal(shape):
    assert autopar.Mesh(shape, "dp") == autopar.Mesh((4,), ("dp",))


def test_three_axis_string_and_default_names():
    mesh = autopar.Mesh("2x4x8")
    assert mesh.shape == (2, 4, 8) and mesh.size == 64
    assert mesh.axis_names == ("ax0", "ax1", "ax2")


@pytest.mark.parametrize("shape, shown", [
    ((2.5, 2), "(2.5, 2)"),
    ((2.0, 2), "(2.0, 2)"),
    ((True, 2), "(True, 2)"),
    (True, "True"),
    ((0, 2), "(0, 2)"),
    ((-1, 4), "(-1, 4)"),
    ((), "()"),
    (2.5, "2.5"),
    ((2, "2"), "(2, '2')"),
    (None, "None"),
])
def test_bad_shapes_name_shape_value_and_fix(shape, shown):
    with pytest.raises(ValueError) as err:
        autopar.Mesh(shape)
    assert str(err.value) == f"mesh shape {shown}: sizes must be positive integers, e.g. (2, 4), 8 or '2x4'"


@pytest.mark.parametrize("text", ["2.5x2", "two", "2x", "x2", "2*2", "-2x2", ""])
def test_unreadable_shape_strings_show_the_accepted_forms(text):
    with pytest.raises(ValueError) as err:
        autopar.Mesh(text)
    assert str(err.value) == (f"cannot read mesh shape {text!r}; write the axis sizes joined by 'x', "
                              f"e.g. '2x4' or '8', or pass a tuple such as (2, 4)")


def test_zero_in_a_shape_string_is_rejected():
    with pytest.raises(ValueError, match=r"mesh shape '0x2': sizes must be positive integers"):
        autopar.Mesh("0x2")


@pytest.mark.parametrize("names, why", [
    ((0, 1), "names must be non-empty strings"),
    (("dp", ""), "names must be non-empty strings"),
    (("dp", None), "names must be non-empty strings"),
    (7, "names must be non-empty strings"),
    (("dp", "dp"), "names repeat"),
    (("dp",), "1 names for the 2 axes of shape (2, 2)"),
    (("pp", "dp", "tp"), "3 names for the 2 axes of shape (2, 2)"),
])
def test_bad_axis_names_name_argument_value_and_fix(names, why):
    with pytest.raises(ValueError) as err:
        autopar.Mesh((2, 2), names)
    assert str(err.value) == (f"mesh axis_names {names!r}: {why}; give one name per axis, distinct "
                              f"non-empty strings, or leave axis_names out for ('ax0', 'ax1')")


@pytest.mark.parametrize("value", [0, 2.5, True, "8"])
def test_bad_devices_per_node(value):
    with pytest.raises(ValueError) as err:
        autopar.Mesh((2, 2), devices_per_node=value)
    assert str(err.value) == f"mesh devices_per_node {value!r}: must be a positive integer, e.g. 8"


def test_memory_sizes_are_read_in_bytes():
    assert parse_bytes("70GiB") == 70 * GiB
    assert parse_bytes("80 GB") == 80e9
    assert parse_bytes("1.5KiB") == 1536.0
    assert parse_bytes(4096) == 4096.0
    assert parse_bytes("1e9") == 1e9
    assert parse_bytes(np.float32(2.0)) == 2.0
    assert parse_bytes(None) is None
    assert autopar.Mesh(4, "dp", memory="40GiB").device.memory == 40 * GiB


FIX = "write a positive size such as '70GiB', '80GB' or a number of bytes"


@pytest.mark.parametrize("value", ["-5GiB", -5, 0, "0B", math.nan, math.inf, -math.inf, "nanGiB", "infGB"])
def test_non_positive_or_non_finite_memory_is_rejected(value):
    with pytest.raises(ValueError) as err:
        parse_bytes(value, "memory_budget")
    assert str(err.value) == f"memory_budget {value!r} is not a positive, finite number of bytes; {FIX}"


@pytest.mark.parametrize("value, message", [
    ("lots", f"cannot read memory size 'lots'; {FIX}"),
    ("GiB", f"cannot read memory size 'GiB'; {FIX}"),
    (True, f"memory size True is not a size; {FIX}"),
    ([1], f"memory size [1] is not a size; {FIX}"),
])
def test_unreadable_memory_names_value_and_fix(value, message):
    with pytest.raises(ValueError) as err:
        parse_bytes(value)
    assert str(err.value) == message


def test_mesh_memory_error_names_the_argument():
    with pytest.raises(ValueError) as err:
        autopar.Mesh((2, 2), ("dp", "tp"), memory="-5GiB")
    assert str(err.value) == f"mesh memory '-5GiB' is not a positive, finite number of bytes; {FIX}"


def test_from_dict_round_trips_a_string_spelled_mesh():
    mesh = autopar.Mesh("2x4", ("dp", "tp"), device="a100", memory="40GiB", bandwidth=(1e9, 4e9))
    again = autopar.Mesh.from_dict(mesh.to_dict())
    assert again == mesh
    assert again.shape == (2, 4) and again.device.memory == 40 * GiB and again.bandwidth == (1e9, 4e9)
