"""Issue 28: libgomp's spin alone and beside a busy neighbour, the measurement behind engine/process/openmp.py.

Offline throughput (`kvflow bench throughput`, SmolLM2-135M shapes, 8 x 64 in / 32 out) on `--cores` cores, quiet and
beside one busy process pinned to the first of them, at several libgomp spin counts (GOMP_SPINCOUNT; 300,000 is
libgomp's default). Runs interleave (repeat, load, spin) so drift spreads over all four. Goal: loaded
within 2.5x of quiet.

    python -m bench.cpu_openmp_policy --cores 2,3 --repeats 3 --spins 1000,10000,30000,300000
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.harness.records import RESULTS, cpu_name, log, write_json
from bench.harness.runs import bench_throughput_cli

DEFAULT_SPIN = "300000"  # libgomp's own when OMP_WAIT_POLICY is unset
LOADS = ("quiet", "one_busy_neighbour")
FLAGS = ("--device", "cpu", "--model", "smollm2-135m", "--load-format", "dummy", "--num-prompts", "8",
         "--input-len", "64", "--output-len", "32", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(256 << 20), "--ignore-eos")


def busy_neighbour(core: int) -> subprocess.Popen:
    neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.sched_setaffinity(neighbour.pid, {core})
    return neighbour


def one_run(spin: str, load: str, cores: list[int]) -> dict[str, Any]:
    neighbour = busy_neighbour(cores[0]) if load != "quiet" else None
    try:
        env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | {"GOMP_SPINCOUNT": spin}
        return bench_throughput_cli(*FLAGS, env=env)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()


def summary(samples: dict[tuple[str, str], list[float]], spins: list[str]) -> dict[str, Any]:
    medians = {f"{spin}/{load}": statistics.median(values) for (spin, load), values in samples.items()}
    slowdown = {spin: round(medians[f"{spin}/quiet"] / medians[f"{spin}/one_busy_neighbour"], 2) for spin in spins}
    return {"median_output_tok_s": medians, "quiet_over_loaded": slowdown}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cores", default="0,1", help="the cores every run is pinned to (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per spin and load (default: %(default)s)")
    parser.add_argument("--spins", default=f"1000,{DEFAULT_SPIN}",
                        help="GOMP_SPINCOUNT values to compare (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu_openmp_policy.json")
    args = parser.parse_args()
    cores = [int(core) for core in args.cores.split(",")]
    os.sched_setaffinity(0, set(cores))  # the engines inherit it
    spins = args.spins.split(",")
    samples: dict[tuple[str, str], list[float]] = {(spin, load): [] for spin in spins for load in LOADS}
    cpu = cpu_name()
    for repeat in range(args.repeats):
        for load in LOADS:
            for spin in spins:
                run = one_run(spin, load, cores)
                samples[spin, load].append(float(run["output_tok_s"]))
                cpu = run.get("cpu_model", cpu)
                log(f"repeat {repeat}: {spin} {load}: {samples[spin, load][-1]:.1f} out tok/s")
    record = {"benchmark": "cpu_openmp_policy", "cpu": cpu, "cores": cores, "flags": list(FLAGS),
              "load_avg_1m_at_end": os.getloadavg()[0],
              "runs": [{"spin": spin, "load": load, "output_tok_s": values} for (spin, load), values in samples.items()],
              **summary(samples, spins)}
    print(record["median_output_tok_s"], record["quiet_over_loaded"])
    write_json(args.out, record)


if __name__ == "__main__":
    main()
