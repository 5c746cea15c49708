"""The benchmarks' memory accounting (benchmarks/common.py): RSS and PSS summed over a
process tree, checked with processes whose memory the test itself allocates."""

import os
import subprocess
import sys
import time
from multiprocessing import shared_memory
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402

MB = 2**20
pytestmark = pytest.mark.skipif(
    not os.path.exists(f"/proc/{os.getpid()}/smaps_rollup"), reason="needs Linux /proc"
)

# A child that touches SIZE MB of the shared segment NAME (or, without NAME, of private
# memory), says so, and waits for stdin to close.
CHILD = """
import sys
from multiprocessing import shared_memory, resource_tracker
size, name = int(sys.argv[1]) * 2**20, sys.argv[2]
if name == "-":
    block = bytearray(size)
    for i in range(0, size, 4096):
        block[i] = 1
else:
    shm = shared_memory.SharedMemory(name=name)
    resource_tracker.unregister(shm._name, "shared_memory")  # the parent owns it
    view = shm.buf
    total = 0
    for i in range(0, size, 4096):
        total += view[i]
print("ready", flush=True)
sys.stdin.read()
"""


def _child(size_mb: int, name: str = "-") -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(size_mb), name],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _stop(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=30)


def test_private_memory_of_a_child_counts_in_both_rss_and_pss():
    before_rss, before_pss = common.tree_usage()[1], common.tree_pss()
    proc = _child(200)
    try:
        rss, pss = common.tree_usage()[1], common.tree_pss()
    finally:
        _stop(proc)
    assert rss - before_rss > 190 * MB
    assert pss - before_pss > 190 * MB


def test_memory_shared_by_two_processes_counts_once_in_pss_and_twice_in_rss():
    size = 160
    shm = shared_memory.SharedMemory(create=True, size=size * MB)
    try:
        shm.buf[:] = b"\x01" * (size * MB)  # the parent touches every page
        before_rss, before_pss = common.tree_usage()[1], common.tree_pss()
        proc = _child(size, shm.name)  # and so does the child: the same pages
        try:
            time.sleep(0.1)
            rss, pss = common.tree_usage()[1], common.tree_pss()
        finally:
            _stop(proc)
    finally:
        shm.close()
        shm.unlink()
    # RSS: the child's copy of the pages is counted again (plus its interpreter).
    assert rss - before_rss > size * MB
    # PSS: the shared pages are split between the two, so the child adds only its own
    # interpreter (a few MB), far less than the segment.
    assert pss - before_pss < size * MB / 4
