"""Planning on several cores (autopar/forked.py): forked processes that compute, talk to the
process that forked them while they work, and give their results (or their errors) back."""
from __future__ import annotations

import os

import pytest

from autopar.forked import forked_lanes, forked_map, worker_count


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


def test_planning_forks_only_onto_idle_cores(monkeypatch):
    """worker_count with no setting: the usable cores less the other runnable threads
    (autopar.forked.idle_cores), at least one; an explicit count or $AUTOPAR_WORKERS wins."""
    import autopar.forked as forked

    monkeypatch.delenv("AUTOPAR_WORKERS", raising=False)
    cores = forked.usable_cores()
    for others, expected in ((0, cores), (cores - 1, 1), (cores + 3, 1)):
        monkeypatch.setattr(forked, "_runnable_threads", lambda n=others: n)
        assert forked.idle_cores(interval_s=0) == expected
        assert worker_count() == expected
    assert worker_count(3) == 3
    monkeypatch.setenv("AUTOPAR_WORKERS", "2")
    assert worker_count() == 2


def test_busy_processes_are_counted_as_running():
    """As many spinning processes as usable cores: they are seen running, so planning stays
    in one process."""
    import subprocess
    import sys

    from autopar.forked import _runnable_threads, idle_cores, usable_cores

    spin = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(usable_cores())]
    try:
        import time

        time.sleep(0.3)
        assert max(_runnable_threads() for _ in range(10)) >= 1
        assert idle_cores() == 1
    finally:
        for p in spin:
            p.kill()
            p.wait()
