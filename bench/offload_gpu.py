#!/usr/bin/env python3
"""CPU weight offload on a GPU (issue 16, `--cpu-offload-gb`): the cost per GB offloaded, Llama-3.1-8B shapes with
random bf16 weights (`--load-format dummy`, preset `llama-3.1-8b`, 15 GiB of weights).

For cpu_offload_gb = 0, 2, 4, 8, each engine in its own subprocess (a fresh GPU; killed after `--job-timeout`
seconds, so a hang cannot eat the device time):
- batch-1 decode: ms per token, the slope between a short and a long greedy generation of one prompt (prefill and
  start-up cancel), best of 3 (of 2 when offloading); CUDA graphs on (the weight copies are captured in them);
- a small offline throughput run: N prompts x 256 in / 32 out, output tok/s (few steps: each one streams every
  offloaded byte);
- the KV blocks the memory profile gives (offloading frees GPU memory for KV) and the offload plan (layers, bytes).
The first job also times a pinned host -> GPU copy of 1 GiB: the PCIe rate that bounds the streaming.

Derived, against cpu_offload_gb = 0: extra ms per decode step per GiB offloaded (the cost per GB), the same
predicted from the measured copy rate, and the KV blocks gained per GiB.

Writes --out (default bench/results/offload_gpu_<device>.json). The whole run stops starting jobs after
`--budget` seconds (default 330: with the last job's timeout, 8 minutes at most) and records the skipped ones. `--smoke` runs on CPU at tiny shapes: the job
code with cpu_offload_gb = 0, and the refusal of cpu_offload_gb > 0 (there is no GPU memory to offload from).

    PYTHONUNBUFFERED=1 python3 bench/offload_gpu.py --out bench/results/offload_gpu_h100.json
    python3 bench/offload_gpu.py --smoke
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

OFFLOAD_GB = (0, 2, 4, 8)
GRAPH_SIZES = [1, 2, 4, 8, 16, 32, 64]  # each capture replays the weight copies: keep the list short
RESULT_TAG = "OFFLOAD_GPU_RESULT "
GiB = 1 << 30


# ---- one engine per subprocess --------------------------------------------------------------------------------
def one(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from kvflow import LLM

    out: dict[str, Any] = {"cpu_offload_gb": job["engine"].get("cpu_offload_gb", 0)}
    if job.get("copy_rate"):
        out["h2d_pinned_gb_s"] = h2d_rate_gb_s()
    started = time.perf_counter()
    llm = LLM(**job["engine"])
    out["load_s"] = round(time.perf_counter() - started, 1)
    runner = llm.llm_engine.runner
    stream = runner.model.weight_stream
    out.update(num_kv_blocks=llm.llm_engine.num_gpu_blocks, cuda_graphs=runner.graphs is not None,
               offloaded_layers=stream.num_layers if stream is not None else 0,
               offloaded_bytes=stream.host_bytes if stream is not None else 0,
               layer_bytes=stream.layer_bytes if stream is not None else None)
    if torch.cuda.is_available():
        out["gpu_memory_allocated_gib"] = round(torch.cuda.memory_allocated() / GiB, 2)
    out.update(batch1_decode(llm, **job["decode"]))
    out.update(throughput(llm, **job["tput"]))
    return out


def h2d_rate_gb_s() -> float:
    """Pinned host -> GPU copy rate of 1 GiB, GB/s (what streaming the offloaded layers is bound by)."""
    import torch

    src = torch.empty(GiB, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(GiB, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        dst.copy_(src, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1000 / 5
    del src, dst
    torch.cuda.empty_cache()
    return round(GiB / seconds / 1e9, 2)


def batch1_decode(llm: Any, short: int, long: int, prompt_len: int, repeats: int) -> dict[str, Any]:
    """ms per token of one sequence's decode: the extra time of `long - short` more tokens (the best time of each
    length over `repeats`, interleaved)."""
    from kvflow import SamplingParams

    prompt = {"prompt_token_ids": [(7 * i + 11) % 20000 + 10 for i in range(prompt_len)]}

    ids: list[int] = []

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        out = llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        elapsed = time.perf_counter() - t0
        ids[:] = out[0].outputs[0].token_ids
        return elapsed

    timed(short)  # warm-up
    pairs = [(timed(short), timed(long)) for _ in range(repeats)]
    ms = 1000 * (min(t for _, t in pairs) - min(t for t, _ in pairs)) / (long - short)
    # The same seeded dummy weights in every job: the greedy ids of offloaded runs must equal the resident run's.
    return {"decode_ms_per_token": round(ms, 3), "decode_tok_s": round(1000 / ms, 2),
            "decode_tokens_timed": long - short, "greedy_ids": ids}


def throughput(llm: Any, num_prompts: int, input_len: int, output_len: int) -> dict[str, Any]:
    from kvflow import SamplingParams
    from kvflow.benchmarks.throughput import random_prompts

    vocab = llm.llm_engine.config.model.arch.vocab_size
    prompts = random_prompts(num_prompts, input_len, vocab, seed=0)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True))
    elapsed = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tput_prompts": num_prompts, "tput_input_len": input_len, "tput_output_len": output_len,
            "tput_elapsed_s": round(elapsed, 2), "output_tok_s": round(num_out / elapsed, 1)}


def run_job(job: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """`offload_gpu.py --one JSON` in a subprocess; its result, or why there is none."""
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(job)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        return {"error": f"timed out after {timeout_s:.0f} s", "stderr_tail": stderr[-2000:]}
    line = next((ln for ln in stdout.splitlines() if ln.startswith(RESULT_TAG)), None)
    if line is None:
        return {"error": f"exit code {proc.returncode}", "stderr_tail": stderr[-2000:]}
    result = json.loads(line[len(RESULT_TAG):])
    result["job_wall_s"] = round(time.monotonic() - started, 1)
    return result


# ---- the run --------------------------------------------------------------------------------------------------
def jobs_for(smoke: bool, num_prompts: int) -> list[dict[str, Any]]:
    if smoke:
        engine = {"model": "tiny", "load_format": "dummy", "device": "cpu", "kv_cache_memory_bytes": 1 << 24,
                  "max_model_len": 512}
        return [{"engine": engine, "decode": {"short": 4, "long": 68, "prompt_len": 16, "repeats": 2},
                 "tput": {"num_prompts": 8, "input_len": 32, "output_len": 8}}]
    jobs = []
    for gb in OFFLOAD_GB:
        engine = {"model": "llama-3.1-8b", "load_format": "dummy", "dtype": "bfloat16", "max_model_len": 4096,
                  "cudagraph_capture_sizes": GRAPH_SIZES, "cpu_offload_gb": gb}
        # Fewer timed tokens where each step streams GiBs (8 GiB at ~25-50 GB/s: 170-350 ms a token).
        decode = {"short": 4, "long": 68, "prompt_len": 128, "repeats": 3} if gb == 0 else \
            {"short": 4, "long": 24, "prompt_len": 128, "repeats": 2}
        jobs.append({"engine": engine, "decode": decode, "copy_rate": gb == 0,
                     "tput": {"num_prompts": num_prompts, "input_len": 256, "output_len": 32}})
    return jobs


def derive(runs: dict[str, dict[str, Any]]) -> None:
    """Per offloaded run: the extra ms per decode step per GiB offloaded, and the KV blocks gained, against 0."""
    base = runs.get("0", {})
    rate = base.get("h2d_pinned_gb_s")
    for name, run in runs.items():
        if name == "0" or "decode_ms_per_token" not in run or "decode_ms_per_token" not in base:
            continue
        gib = run["offloaded_bytes"] / GiB
        extra = run["decode_ms_per_token"] - base["decode_ms_per_token"]
        run.update(offloaded_gib=round(gib, 3), extra_ms_per_token=round(extra, 3),
                   extra_ms_per_token_per_gib=round(extra / gib, 3) if gib else None,
                   kv_blocks_gained=run["num_kv_blocks"] - base["num_kv_blocks"],
                   kv_blocks_gained_per_gib=round((run["num_kv_blocks"] - base["num_kv_blocks"]) / gib, 1)
                   if gib else None,
                   decode_vs_resident=round(base["decode_ms_per_token"] / run["decode_ms_per_token"], 3))
        if rate:  # what the copies alone cost at the measured pinned rate
            run["predicted_ms_per_gib_from_copy_rate"] = round(1000 * GiB / (rate * 1e9), 3)
        if "output_tok_s" in run and "output_tok_s" in base:
            run["throughput_vs_resident"] = round(run["output_tok_s"] / base["output_tok_s"], 3)
        if "greedy_ids" in run and "greedy_ids" in base:  # over the tokens both generated (runs differ in length)
            common = min(len(run["greedy_ids"]), len(base["greedy_ids"]))
            run["greedy_ids_compared"] = common
            run["greedy_ids_equal_resident"] = run["greedy_ids"][:common] == base["greedy_ids"][:common]


def smoke_refusals() -> dict[str, str]:
    """cpu_offload_gb > 0 on CPU is refused at configuration (no GPU memory to offload from)."""
    from engine.arg_utils import EngineArgs

    out = {}
    for gb in OFFLOAD_GB[1:]:
        try:
            EngineArgs(model="tiny", load_format="dummy", device="cpu", cpu_offload_gb=gb).create_engine_config()
            out[str(gb)] = "ACCEPTED (unexpected)"
        except ValueError as exc:
            out[str(gb)] = f"refused: {exc}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes (offload itself is refused there)")
    parser.add_argument("--num-prompts", type=int, default=64, help="throughput prompts (256 in / 32 out)")
    parser.add_argument("--job-timeout", type=float, default=150.0, help="seconds per engine subprocess")
    parser.add_argument("--budget", type=float, default=330.0,
                        help="no job starts after this many seconds (with --job-timeout: at most 8 minutes)")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        print(RESULT_TAG + json.dumps(one(json.loads(args.one))), flush=True)
        return
    import torch

    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --smoke on CPU (cpu_offload_gb > 0 needs a GPU)")
    device = "cpu" if args.smoke else torch.cuda.get_device_name()
    record: dict[str, Any] = {
        "device": device, "torch": torch.__version__, "smoke": args.smoke,
        "workload": ("tiny fp32 on CPU, cpu_offload_gb = 0 only" if args.smoke else
                     f"llama-3.1-8b shapes, dummy bf16 weights, CUDA graphs {GRAPH_SIZES}, max_model_len 4096; "
                     f"batch-1 decode (128-token prompt); {args.num_prompts} x 256/32 throughput"),
        "runs": {}}
    started = time.monotonic()
    for job in jobs_for(args.smoke, args.num_prompts):
        name = str(job["engine"].get("cpu_offload_gb", 0))
        if time.monotonic() - started > args.budget:
            record["runs"][name] = {"error": f"skipped: the {args.budget:.0f} s budget was spent"}
            continue
        record["runs"][name] = result = run_job(job, args.job_timeout)
        print(name, json.dumps(result), flush=True)
    if args.smoke:
        record["refused_on_cpu"] = smoke_refusals()
    derive(record["runs"])
    record["total_s"] = round(time.monotonic() - started, 1)
    tag = "smoke" if args.smoke else device.lower().replace(" ", "_")
    out = args.out or ROOT / "bench" / "results" / f"offload_gpu_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out}")
    if any("error" in run for run in record["runs"].values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
