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



def _gone(pid: int) -> bool:
    """Whether process `pid` has ended (a zombie counts: it runs nothing)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not os.path.isdir("/proc") or worker_count(2) < 2, reason="Linux forked workers")
@pytest.mark.parametrize("how", ["map", "lanes"])
def test_forked_planners_die_with_the_process_that_forked_them(tmp_path, how):
    """A planner killed while its forked workers compute (killed for memory, or by hand)
    leaves none of them running: they get the parent-death signal."""
    import subprocess
    import sys
    import time
    script = f"""
import os, sys, time
from autopar.solve.forked import forked_lanes, forked_map
main = os.getpid()
def work(k, *rest):
    if os.getpid() != main:
        open(os.path.join(sys.argv[1], str(os.getpid())), "w").close()
    time.sleep(120)
if {how!r} == "map":
    forked_map(work, range(2), 2)
else:
    forked_lanes(lambda peers: time.sleep(120), work, 2)
"""
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)])
    try:
        deadline = time.monotonic() + 60
        while not os.listdir(tmp_path) and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = [int(n) for n in os.listdir(tmp_path)]
        assert workers, "no forked worker started"
        assert not any(_gone(w) for w in workers)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while not all(_gone(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(_gone(w) for w in workers), f"forked workers {workers} outlived their parent"
