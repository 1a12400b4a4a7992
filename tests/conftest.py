"""Shared fixtures: `pool4` and `pool2`, gloo worker pools kept for the whole session.

A pool starts on the first test that asks for it and stops when the session ends; see
tests/distributed.py for what a job may be.
"""
import os
import sys

import pytest

_TESTS = os.path.dirname(os.path.abspath(__file__))
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)

from distributed import WorkerPool  # noqa: E402


def _pool_fixture(world_size: int):
    @pytest.fixture(scope="session")
    def pool():
        p = WorkerPool(world_size)
        try:
            yield p
        finally:
            p.close()

    pool.__doc__ = f"A WorkerPool of {world_size} gloo ranks, started on first use."
    return pool


pool4 = _pool_fixture(4)
pool2 = _pool_fixture(2)


@pytest.fixture(scope="module")
def pool8():
    """A WorkerPool of 8 gloo ranks for one test module (3-D layouts), closed after it."""
    p = WorkerPool(8)
    try:
        yield p
    finally:
        p.close()
