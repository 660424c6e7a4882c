"""engine/process/gc_heap.py: the start-up heap leaves the cyclic collector's full collections, while garbage made
after the freeze is still collected. Run in a child process: freezing is process-wide, and the test process builds
many engines."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

CHILD = """
import gc, weakref
from engine.process.gc_heap import freeze_startup_heap

class Node:
    pass

startup = [Node() for _ in range(100_000)]      # long-lived objects a worker holds after start-up
frozen = freeze_startup_heap("test")
assert frozen >= 100_000 and gc.get_freeze_count() == frozen, frozen
tracked = len(gc.get_objects())
assert tracked < 1_000, tracked                  # a full collection no longer walks the start-up heap

later = Node()                                   # a cycle made while serving is still found and freed
later.self = later
alive = weakref.ref(later)
del later
gc.collect()
assert alive() is None
print("ok", frozen, tracked)
"""


def test_freeze_moves_the_startup_heap_out_and_later_cycles_are_still_collected() -> None:
    done = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stdout + done.stderr
