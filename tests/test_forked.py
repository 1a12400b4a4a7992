"""Planning on several cores (autopar/solve/forked.py): forked processes that compute, talk to the
process that forked them while they work, and give their results (or their errors) back."""
from __future__ import annotations

import os

import pytest

from autopar.solve.forked import forked_lanes, forked_map, worker_count


def test_forked_map_keeps_the_order_and_uses_other_processes():
    got = forked_map(lambda x: (x * x, os.getpid()), list(range(7)), 3)
    assert [v for v, _ in got] == [x * x for x in range(7)]
    assert got[0][1] == os.getpid() == got[3][1] and len({pid for _, pid in got}) >= 2


def test_lanes_send_to_each_other_at_once():
    """Both ends send a megabyte before either reads (a pipe holds far less): neither waits
    on the other; a third process gets what the first forked one sent through this one."""
    big = bytes(range(256)) * 4096

    def here(peers):
        for peer in peers:
            peer.send(("from here", big))
        first = peers[0].recv()
        peers[1].send(first)
        return first[0], os.getpid()

    def there(k, peer):
        if k == 1:
            peer.send((f"from lane {k}", big))
            got = [peer.recv()]
        else:
            got = [peer.recv(), peer.recv()]
        assert all(payload == big for _, payload in got)
        return k, [who for who, _ in got], worker_count(4)

    out = forked_lanes(here, there, 3)
    assert out[0] == ("from lane 1", os.getpid())
    assert out[1:] == [(1, ["from here"], 1), (2, ["from here", "from lane 1"], 1)]   # (no forks inside a lane)


def test_an_error_in_a_lane_is_raised_here():
    def here(peers):
        return peers[0].recv()

    def there(k, peer):
        raise KeyError(f"lane {k} failed")

    with pytest.raises(KeyError, match="lane 1 failed"):
        forked_lanes(here, there, 2)


def test_an_error_here_stops_the_lanes():
    def here(peers):
        raise ValueError("here failed")

    def there(k, peer):
        return peer.recv()   # (never answered: stopped)

    with pytest.raises(ValueError, match="here failed"):
        forked_lanes(here, there, 3)


def test_a_value_that_cannot_be_sent_is_an_error_here():
    def here(peers):
        return None

    def there(k, peer):
        return lambda: k   # (a closure does not pickle)

    with pytest.raises(RuntimeError, match="could not send its function"):
        forked_lanes(here, there, 2)

