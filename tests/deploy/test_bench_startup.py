"""`kvflow bench startup`'s memory sampler: a process tree's summed RSS, children included."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvflow.benchmarks.startup import PeakMemory, format_line, process_tree, rss_bytes


def test_the_sampler_sums_a_process_tree_with_its_children() -> None:
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(200 << 20); import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while rss_bytes(child.pid) < 150 << 20:  # until the child holds its 200 MB
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.1)
        assert child.pid in process_tree(os.getpid())
        memory = PeakMemory(os.getpid())
        time.sleep(0.5)
        peak = memory.stop()
        assert peak >= rss_bytes(os.getpid()) + (150 << 20)
    finally:
        child.kill()
        child.wait()


def test_the_line_names_the_three_figures() -> None:
    line = format_line({"model": "smollm2", "ready_s": 9.5, "first_answer_s": 11.0, "peak_rss_gb": 3.9})
    assert "9.5 s" in line and "11.0 s" in line and "3.9 GB" in line
