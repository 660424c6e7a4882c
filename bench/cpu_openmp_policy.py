"""Issue 28: libgomp's spin alone and beside a busy neighbour, the measurement behind engine/process/openmp.py.

`kvflow bench throughput` (SmolLM2-135M shapes, CPU, 8 x 64 in / 32 out) pinned to `--cores`, quiet and beside one
busy process on the first of them, per GOMP_SPINCOUNT (libgomp's default: 300000); runs interleave so drift spreads.
Run as `python -m bench.cpu_openmp_policy --cores 2,3 --repeats 3 --spins 1000,10000,30000,300000`."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.harness.records import RESULTS, log, write_json
from bench.harness.runs import bench_throughput_cli

LOADS = ("quiet", "one_busy_neighbour")
FLAGS = ("--device", "cpu", "--model", "smollm2-135m", "--load-format", "dummy", "--num-prompts", "8",
         "--input-len", "64", "--output-len", "32", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20),
         "--ignore-eos")


def one_run(spin: str, load: str, core: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"GOMP_SPINCOUNT": spin}
    if load == "quiet":
        return bench_throughput_cli(*FLAGS, env=env)
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(neighbour.pid, {core})
        return bench_throughput_cli(*FLAGS, env=env)
    finally:
        neighbour.kill()
        neighbour.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", default="0,1", help="the cores every run is pinned to (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per spin and load (default: %(default)s)")
    parser.add_argument("--spins", default="1000,300000", help="GOMP_SPINCOUNT values (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_openmp_policy.json")
    args = parser.parse_args()
    cores, spins = [int(core) for core in args.cores.split(",")], args.spins.split(",")
    os.sched_setaffinity(0, set(cores))  # the engines inherit it
    samples: dict[str, list[float]] = {f"{spin}/{load}": [] for spin in spins for load in LOADS}
    for _, load, spin in ((r, load, spin) for r in range(args.repeats) for load in LOADS for spin in spins):
        run = one_run(spin, load, cores[0])
        samples[f"{spin}/{load}"].append(float(run["output_tok_s"]))
        log(f"{spin} {load}: {run['output_tok_s']:.1f} out tok/s")
    medians = {key: statistics.median(values) for key, values in samples.items()}
    write_json(args.out, {
        "benchmark": "cpu_openmp_policy", "cpu": run["cpu_model"], "cores": cores, "flags": list(FLAGS),
        "load_avg_1m_at_end": os.getloadavg()[0], "median_output_tok_s": medians,
        "runs": [{"spin": key.split("/")[0], "load": key.split("/")[1], "output_tok_s": v} for key, v in samples.items()],
        "quiet_over_loaded": {s: round(medians[f"{s}/quiet"] / medians[f"{s}/{LOADS[1]}"], 2) for s in spins}})


if __name__ == "__main__":
    main()
