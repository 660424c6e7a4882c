#!/usr/bin/env python3
"""Does the stats line of `kvflow serve` agree with `kvflow bench serve`? (issue 16: within 10 %.)

Starts `kvflow serve --model smollm2` (CPU, default 1 prefill + 1 decode worker, stats on by default, vLLM's fixed
10 s interval), runs `kvflow bench serve` against it for long enough to span several stats intervals, then reads
the workers' logs (`--log-dir`) for vLLM's line ("Engine 000: Avg prompt throughput: ... Avg generation
throughput: ...").

Each line's figures are over the interval since that worker's previous line. The intervals that lie wholly inside
the benchmark's window are the ones compared (vLLM's line averages over wall time, idle included, so the intervals
cut by the window's edges are left out): their generation throughput, time-weighted per worker and summed
over the decode workers (they emit every output token; a prefill worker's line also counts the first token it
samples, which the decode worker counts again), against the bench's output tok/s (its total output tokens over its
duration). Prompt throughput is reported beside the bench's input tok/s.

Writes bench/results/stats_line_smollm2_cpu.json (both numbers, the ratio, every in-window line).

    PYTHONPATH=. python3 bench/stats_line_check.py
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from kvflow.launcher import free_port  # noqa: E402

LINE = re.compile(r"^(?P<ts>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO kvflow\.stats: Engine \d+: Avg prompt throughput: "
                  r"(?P<prompt>[\d.]+) tokens/s, Avg generation throughput: (?P<gen>[\d.]+) tokens/s")
SLACK_S = 0.5  # an interval may start this much before the window (the bench's client start-up)
INTERVAL_S = 10.0  # engine/metrics/stat_logger.py LOG_INTERVAL_S: the first line's interval (no line before it)


@dataclass(frozen=True)
class StatsLine:
    worker: str  # log file stem, e.g. decode-1
    start: float  # the previous line's time (epoch seconds)
    end: float
    prompt_tok_s: float
    gen_tok_s: float


def parse_lines(log: Path) -> list[StatsLine]:
    """The stats lines of one worker log, each with the interval it covers: from that worker's previous line (the
    first one's from INTERVAL_S before it, when the logger's clock started: at least that, by a few 0.1 s)."""
    out: list[StatsLine] = []
    previous: float | None = None
    for text in log.read_text(errors="replace").splitlines():
        match = LINE.match(text)
        if match is None:
            continue
        at = datetime.strptime(match["ts"], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # local time, as logged
        start = at - INTERVAL_S if previous is None else previous
        out.append(StatsLine(log.stem, start, at, float(match["prompt"]), float(match["gen"])))
        previous = at
    return out


def weighted(lines: list[StatsLine], field: str) -> float:
    """tokens / seconds over the lines' intervals (a throughput averaged over time, not over lines)."""
    seconds = sum(line.end - line.start for line in lines)
    return sum(getattr(line, field) * (line.end - line.start) for line in lines) / seconds


def wait_healthy(process: subprocess.Popen, url: str, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            raise SystemExit(f"kvflow serve exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"kvflow serve not healthy in {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=96)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=96)
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--min-intervals", type=int, default=3, help="fail unless this many intervals are compared")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "stats_line_smollm2_cpu.json")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvflow-stats-check-"))
    log_dir, serve_log, bench_json = work / "workers", work / "serve.log", work / "bench.json"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    serve_argv = [sys.executable, "-m", "kvflow.cli", "serve", "--model", "smollm2", "--port", str(port),
                  "--grpc-port", "0", "--log-dir", str(log_dir), "--max-model-len", "1024",
                  "--kv-cache-memory-bytes", str(256 << 20)]
    with open(serve_log, "wb") as out:
        serve = subprocess.Popen(serve_argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    try:
        wait_healthy(serve, url, serve_log, 300)
        bench_argv = [sys.executable, "-m", "kvflow.cli", "bench", "serve", "--base-url", url, "--dataset", "random",
                      "--num-prompts", str(args.num_prompts), "--input-len", str(args.input_len), "--output-len",
                      str(args.output_len), "--max-concurrency", str(args.max_concurrency), "--output-json",
                      str(bench_json)]
        subprocess.run(bench_argv, env=env, cwd=ROOT, check=True)
        bench_end = time.time()
        time.sleep(12)  # one more interval: the line that closes the benchmark's last full interval is written
    finally:
        serve.terminate()
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            serve.kill()
    bench = json.loads(bench_json.read_text())
    window = (bench_end - bench["duration"] - SLACK_S, bench_end)

    lines = [line for log in sorted(log_dir.glob("*.log")) for line in parse_lines(log)]
    inside = [line for line in lines if line.start >= window[0] and line.end <= window[1]]
    by_worker: dict[str, list[StatsLine]] = {}
    for line in inside:
        by_worker.setdefault(line.worker, []).append(line)
    per_worker = {name: {"intervals": len(ls), "seconds": round(sum(x.end - x.start for x in ls), 2),
                         "gen_tok_s": round(weighted(ls, "gen_tok_s"), 2),
                         "prompt_tok_s": round(weighted(ls, "prompt_tok_s"), 2)} for name, ls in by_worker.items()}
    decode = {name: w for name, w in per_worker.items() if name.startswith("decode")}
    stats_gen = sum(w["gen_tok_s"] for w in decode.values())
    stats_prompt = sum(w["prompt_tok_s"] for w in per_worker.values())
    ratio = stats_gen / bench["output_throughput"] if bench["output_throughput"] else None
    # Counting check, independent of the window: every decode line's rate x its interval adds up to the tokens the
    # bench received (each line rounds to 0.1 tok/s, and the first interval is taken as 10 s).
    decode_tokens = sum(line.gen_tok_s * (line.end - line.start) for line in lines if line.worker.startswith("decode"))
    record: dict[str, Any] = {
        "workload": (f"kvflow serve --model smollm2 (CPU, 1 prefill + 1 decode worker) under kvflow bench serve: "
                     f"{args.num_prompts} random prompts x {args.input_len} in / {args.output_len} out, "
                     f"concurrency {args.max_concurrency}; stats interval 10 s"),
        "bench_output_tok_s": round(bench["output_throughput"], 2),
        "bench_input_tok_s": round(bench["total_input_tokens"] / bench["duration"], 2),
        "bench_duration_s": round(bench["duration"], 2),
        "bench_completed": bench["completed"], "bench_failed": bench["failed"],
        "stats_generation_tok_s_decode_workers": round(stats_gen, 2),
        "stats_prompt_tok_s_all_workers": round(stats_prompt, 2),
        "stats_generation_tokens_decode_workers_whole_run": round(decode_tokens, 1),
        "bench_total_output_tokens": bench["total_output_tokens"],
        "ratio_stats_over_bench": round(ratio, 4) if ratio is not None else None,
        "within_10_percent": ratio is not None and abs(ratio - 1) <= 0.10,
        "intervals_compared": {name: w["intervals"] for name, w in per_worker.items()},
        "per_worker": per_worker,
        "lines_in_window": [asdict(line) | {"start": round(line.start - window[0], 2),
                                            "end": round(line.end - window[0], 2)} for line in inside],
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k not in ("lines_in_window", "per_worker")}, indent=2))
    print(f"wrote {args.out} (logs in {work})")
    if min((w["intervals"] for w in decode.values()), default=0) < args.min_intervals:
        raise SystemExit(f"fewer than {args.min_intervals} stats intervals inside the benchmark window: lengthen it")
    if not record["within_10_percent"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
