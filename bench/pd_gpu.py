#!/usr/bin/env python3
"""GPU-native disaggregation, checked and timed in one script (the P/D issue's benchmarks a-d).

Parts (`--parts`, in this order):
  check     token-exact: greedy ids of a tiny fp32 model through P/D over NCCL equal local prefill's; a hung, then
            a killed, prefill worker mid-transfer: the decode side recomputes and a new link follows (PASS/FAIL)
  share     `kvflow serve` with default flags on one GPU (prefill and decode worker share it)
  transfer  a+b: `kvflow bench pd` on Llama-3.1-8B shapes, 1 prefill GPU + 1 decode GPU over NCCL: KV transfer
            GB/s and ms at 1k/4k/16k tokens, TTFT disaggregated vs local prefill
  local     d: one GPU, `kvflow serve` with local prefill under 256 x 512/128 at concurrency 64, against
            `LLM.generate` (`kvflow bench throughput`) on the same shapes
  headline  c: 1 prefill GPU + 1 decode GPU against two unified replicas (two decode workers that prefill
            locally) behind the same router; 2048 in / 256 out, Poisson arrivals, a sweep of rates; TTFT p99,
            TPOT p99 and goodput under the stated SLO

Each part writes $OUT/pd_gpu_<part>.json as soon as it finishes (`--out`). Records carry `workload` and
`device`; transfer records `prompt_tokens`, `transfer_gbps`, `ttft_disagg_s`, `ttft_local_s`; the headline
record `goodput_rps` and `tpot_p99_s` (dicts keyed `1p1d` and `2x_unified`) and `slo`.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
        PYTHONUNBUFFERED=1 python3 bench/pd_gpu.py --parts check transfer local --out $OUT
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from engine.arg_utils import EngineArgs  # noqa: E402
from kvflow.benchmarks.pd import device_name, run_pd_bench  # noqa: E402
from kvflow.benchmarks.serve import make_prompts, run_benchmark, summarize  # noqa: E402
from kvflow.launcher import free_port  # noqa: E402

SLO = {"ttft_s": 1.0, "tpot_s": 0.040}  # stated before measuring: the example
STRICT_SLO = {"ttft_s": 1.0, "tpot_s": 0.020}  # a second, interactive-grade SLO, reported beside it
MODEL = ["--model", "llama-3.1-8b", "--load-format", "dummy"]
SMOKE_MODEL = ["--model", "tiny", "--load-format", "dummy"]  # --smoke: the plumbing on any machine, GPUs or not
VOCAB = {"llama-3.1-8b": 30000, "tiny": 500}  # prompt ids drawn below this


def gpu_flags(*lists: tuple[str, list[int]]) -> list[str]:
    """--prefill-gpus / --decode-gpus only where there are two GPUs (a --smoke run on CPU places nothing)."""
    import torch

    if torch.cuda.device_count() < 2:
        return []
    return [item for flag, gpus in lists for item in (flag, *map(str, gpus))]


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def write(out: Path, name: str, payload: Any) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / f"pd_gpu_{name}.json").write_text(json.dumps(payload, indent=1) + "\n")


# ---- a kvflow serve subprocess ---------------------------------------------------------------------------------
class Serve:
    def __init__(self, flags: list[str], log_dir: Path, extra_env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.log_path = log_dir / f"serve-{self.port}.log"
        argv = [sys.executable, "-m", "kvflow.cli", "serve", *flags, "--port", str(self.port), "--grpc-port", "0",
                "--log-dir", str(log_dir / f"workers-{self.port}"), "--disable-log-requests"]
        self.process = subprocess.Popen(argv, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT, cwd=ROOT,
                                        env={**os.environ, "PYTHONUNBUFFERED": "1", **(extra_env or {})})
        self.url = f"http://127.0.0.1:{self.port}"

    def wait(self, timeout_s: float = 420) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvflow serve exited: {self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"kvflow serve not healthy: {self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()


ATTAINMENT = 0.9


def attainment(summary: dict[str, Any], slo: dict[str, float]) -> float:
    rows = summary["per_request"]
    good = sum(1 for r in rows if r["ttft_ms"] <= slo["ttft_s"] * 1e3 and r["tpot_ms"] <= slo["tpot_s"] * 1e3)
    return good / max(len(rows) + summary["failed"], 1)


def attained_rate(sweep: list[dict[str, Any]], slo: dict[str, float]) -> float:
    """The highest rate with >= ATTAINMENT of requests meeting `slo`: the highest sweep point that attains it,
    plus the linear interpolation towards the next point, which does not."""
    points = sorted((s["request_rate"], attainment(s, slo)) for s in sweep)
    best = 0.0
    for (rate, att), nxt in zip(points, [*points[1:], None], strict=True):
        if att < ATTAINMENT:
            continue
        best = rate
        if nxt is not None and nxt[1] < ATTAINMENT:
            best = rate + (nxt[0] - rate) * (att - ATTAINMENT) / (att - nxt[1])
    return best


def bench_serve(url: str, prompts: list[list[int]], output_len: int, rate: float, concurrency: int | None,
                seed: int = 0) -> dict[str, Any]:
    results, duration = asyncio.run(run_benchmark(url, None, prompts, output_len, rate, concurrency, None, seed))
    summary = summarize(results, duration, {"ttft": SLO["ttft_s"] * 1e3, "tpot": SLO["tpot_s"] * 1e3})
    strict = summarize(results, duration, {"ttft": STRICT_SLO["ttft_s"] * 1e3, "tpot": STRICT_SLO["tpot_s"] * 1e3})
    summary["request_goodput_strict"] = strict["request_goodput"]
    ok = [r for r in results if r.ok]
    summary["per_request"] = [{"ttft_ms": round(r.ttft_s * 1e3, 2), "tpot_ms": round(
        (r.e2e_s - r.ttft_s) / (r.output_tokens - 1) * 1e3 if r.output_tokens > 1 else 0.0, 3)} for r in ok]
    summary.pop("_series_ms")
    return summary


# ---- parts -----------------------------------------------------------------------------------------------------
def part_check(out: Path, gpus: bool) -> dict[str, Any]:
    """Greedy ids of a tiny fp32 model: disaggregated over NCCL vs local prefill on the same decode worker."""
    from cluster.auth import ClusterAuth
    from kvflow.launcher import ClusterSpec, WorkerCluster
    from protos.kvflow.v1 import kvflow_pb2 as pb
    from protos.kvflow.v1 import kvflow_pb2_grpc

    args = EngineArgs(model="tiny", load_format="dummy", dtype="float32", max_model_len=1024,
                      gpu_memory_utilization=0.3, usage_context="server")
    spec = ClusterSpec(args, 1, 1, prefill_gpus=(0,) if gpus else None, decode_gpus=(1,) if gpus else None,
                       kv_transfer_backend="nccl", gpu_memory_utilization=0.3,
                       worker_extra_args=("--max-num-batched-tokens", "16"), auth=ClusterAuth().with_token())  # many chunks: time to fault mid-way
    checks = []
    with WorkerCluster(spec) as cluster:
        cluster.wait_ready(600, progress=False)
        prefill, decode = cluster.addresses("prefill")[0], cluster.addresses("decode")[0]
        with spec.auth.channel(decode) as channel:
            stub = kvflow_pb2_grpc.GenerationStub(channel)
            for i, length in enumerate((3, 16, 17, 100, 500, 990)):
                prompt = [(7919 * (i + 1) * (k + 3)) % 400 + 50 for k in range(length)]  # tiny: 512 ids
                got = {}
                for name, minimum in (("local", 1 << 30), ("disaggregated", 0)):
                    request = pb.GenerateRequest(
                        token_ids=pb.TokenIds(ids=prompt), cache_salt=[name],
                        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
                        disaggregation=pb.DisaggregationParams(prefill_address=prefill, min_prompt_tokens=minimum))
                    complete = list(stub.Generate(request, timeout=300))[-1].complete
                    got[name] = (list(complete.choices[0].token_ids), complete.prefill_path)
                same = got["local"][0] == got["disaggregated"][0]
                path_ok = got["disaggregated"][1] == pb.PREFILL_PATH_DISAGGREGATED
                checks.append({"prompt_tokens": length, "equal": same, "disaggregated_path": path_ok})
                log(f"{'PASS' if same and path_ok else 'FAIL'} tiny fp32 greedy, {length} tokens: P/D over NCCL "
                    f"== local prefill ({len(got['local'][0])} ids)")
        faults = _fault_checks(cluster, decode, prefill)
    record = {"workload": "pd_nccl_token_exact_tiny_fp32", "device": device_name(), "checks": checks,
              "faults": faults,
              "pass": all(c["equal"] and c["disaggregated_path"] for c in checks) and all(f["pass"] for f in faults)}
    write(out, "check", record)
    return record


def _fault_checks(cluster: Any, decode: str, prefill: str) -> list[dict[str, Any]]:
    """The prefill worker stopped (a hung peer), then killed, mid-transfer over NCCL: the decode worker notices
    (missing heartbeats / a closed stream), recomputes locally and answers; no decode block stays stranded."""
    import threading

    import grpc

    from protos.kvflow.v1 import kvflow_pb2 as pb
    from protos.kvflow.v1 import kvflow_pb2_grpc

    worker = next(w for w in cluster.workers if w.role == "prefill")
    stub = kvflow_pb2_grpc.GenerationStub(cluster.spec.auth.channel(decode))
    prefill_stub = kvflow_pb2_grpc.PrefillStub(cluster.spec.auth.channel(prefill))
    results = []
    for kind, sig in (("hung", signal.SIGSTOP), ("killed", signal.SIGKILL)):
        baseline = prefill_stub.Info(pb.InfoRequest(), timeout=10).num_free_kv_blocks
        decode_free = stub.Info(pb.InfoRequest(), timeout=10).num_free_kv_blocks
        prompt = [(31 * k + len(kind)) % 400 + 50 for k in range(990)]
        request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=prompt), cache_salt=[kind],
                                     sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=8),
                                     disaggregation=pb.DisaggregationParams(prefill_address=prefill))
        outcome: dict[str, Any] = {}

        def consume(request: Any = request, outcome: dict[str, Any] = outcome) -> None:
            try:
                outcome["complete"] = list(stub.Generate(request, timeout=120))[-1].complete
            except grpc.RpcError as exc:
                outcome["error"] = str(exc)
            outcome["at"] = time.monotonic()

        thread = threading.Thread(target=consume)
        thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "at" not in outcome:  # wait until the prefill holds blocks
            if prefill_stub.Info(pb.InfoRequest(), timeout=10).num_free_kv_blocks < baseline:
                break
        worker.process.send_signal(sig)
        hit_at = time.monotonic()
        thread.join(120)
        complete = outcome.get("complete")
        recovered = complete is not None and complete.prefill_path == pb.PREFILL_PATH_LOCAL
        seconds = outcome.get("at", hit_at) - hit_at
        time.sleep(1.0)
        stranded = stub.Info(pb.InfoRequest(), timeout=10).num_free_kv_blocks != decode_free
        ok = recovered and not stranded
        results.append({"fault": kind, "pass": ok, "recovered_locally": recovered, "seconds_to_answer": seconds,
                        "stranded_decode_blocks": stranded, "error": outcome.get("error")})
        log(f"{'PASS' if ok else 'FAIL'} prefill {kind} mid-transfer over NCCL: answered after {seconds:.2f} s "
            f"(recomputed locally: {recovered}, stranded decode blocks: {stranded})")
        if kind == "hung":
            worker.process.send_signal(signal.SIGCONT)
            # The same peer answers again: a new link to it must work (the old one was torn down).
            fresh = [(17 * k) % 400 + 50 for k in range(300)]
            again = pb.GenerateRequest(token_ids=pb.TokenIds(ids=fresh), cache_salt=["again"],
                                       sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=4),
                                       disaggregation=pb.DisaggregationParams(prefill_address=prefill))
            path = None
            for _ in range(10):
                path = list(stub.Generate(again, timeout=60))[-1].complete.prefill_path
                if path == pb.PREFILL_PATH_DISAGGREGATED:
                    break
                time.sleep(1.0)  # the reopen backoff
                again.cache_salt[0] += "+"
            rebuilt = path == pb.PREFILL_PATH_DISAGGREGATED
            results.append({"fault": "link_rebuilt_after_hang", "pass": rebuilt})
            log(f"{'PASS' if rebuilt else 'FAIL'} a new NCCL link to the resumed prefill worker")
    return results


def part_transfer(out: Path, model: list[str], prompt_lens: list[int], reps: int, gpus: bool
                  ) -> list[dict[str, Any]]:
    args = EngineArgs(model=model[1], load_format="dummy", max_model_len=max(prompt_lens) + 64)
    records = run_pd_bench(args, prompt_lens, reps, output_len=4, kv_transfer_backend="nccl",
                           prefill_gpus=(0,) if gpus else None, decode_gpus=(1,) if gpus else None,
                           gpu_memory_utilization=0.9 if gpus else None)
    for r in records:
        log(f"{r['prompt_tokens']:>6} tokens: transfer {r['transfer_ms']:.2f} ms = {r['transfer_gbps'] or 0:.1f} GB/s "
            f"({r['transfer_share_of_ttft']:.1%} of TTFT); TTFT disaggregated {r['ttft_disagg_s'] * 1e3:.1f} ms vs "
            f"local {r['ttft_local_s'] * 1e3:.1f} ms = {r['ttft_ratio']:.2f}x")
    write(out, "transfer", records)
    return records


def part_local(out: Path, log_dir: Path, model: list[str], num_prompts: int, input_len: int, output_len: int
               ) -> dict[str, Any]:
    """d: one GPU. Offline LLM.generate first (own process), then the served cluster with local prefill."""
    offline_json = log_dir / "offline.json"
    subprocess.run([sys.executable, "-m", "kvflow.cli", "bench", "throughput", *model, "--num-prompts",
                    str(num_prompts), "--input-len", str(input_len), "--output-len", str(output_len), "--ignore-eos",
                    "--output-json", str(offline_json)],
                   cwd=ROOT, check=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": _first_gpu()})
    offline = json.loads(offline_json.read_text())
    log(f"LLM.generate {num_prompts} x {input_len}/{output_len}: {offline['output_tok_s']:.0f} out tok/s")
    serve = Serve([*model, "--prefill-workers", "0", "--decode-workers", "1", *gpu_flags(("--decode-gpus", [0]))],
                  log_dir)
    try:
        serve.wait()
        prompts = make_prompts("random", num_prompts, input_len, 0, 0, seed=1, vocab=VOCAB[model[1]])
        bench_serve(serve.url, prompts[:64], output_len, float("inf"), 64)  # warm-up at the run's shapes
        served = bench_serve(serve.url, prompts, output_len, float("inf"), 64)
    finally:
        serve.stop()
    ratio = served["output_throughput"] / offline["output_tok_s"]
    log(f"kvflow serve (local prefill) at concurrency 64: {served['output_throughput']:.0f} out tok/s = "
        f"{ratio:.2f}x LLM.generate; TTFT p50 {served['median_ttft_ms']:.0f} ms, TPOT p50 "
        f"{served['median_tpot_ms']:.1f} ms")
    served.pop("per_request")
    record = {"workload": f"serve_local_prefill_vs_llm_generate_{model[1]}_{num_prompts}x{input_len}_{output_len}",
              "device": device_name(),
              "served_output_tok_s": served["output_throughput"], "offline_output_tok_s": offline["output_tok_s"],
              "ratio": ratio, "concurrency": 64, "served": served, "offline": offline}
    write(out, "local", record)
    return record


def part_share(out: Path, log_dir: Path, model: list[str], input_len: int) -> dict[str, Any]:
    """`kvflow serve` with default flags on one GPU: a prefill and a decode worker share it (0.45 each, started
    one after the other), and disaggregated requests flow over NCCL between two processes on one device."""
    env_gpu = {"CUDA_VISIBLE_DEVICES": _first_gpu()}
    serve = Serve(model, log_dir, extra_env=env_gpu)
    try:
        serve.wait()
        prompts = make_prompts("random", 8, input_len, 0, 0, seed=5, vocab=VOCAB[model[1]])
        summary = bench_serve(serve.url, prompts, 16, float("inf"), 4)
    finally:
        serve.stop()
    logs = "".join(p.read_text(errors="replace") for p in sorted(log_dir.glob(f"workers-{serve.port}/*.log")))
    shares = sorted({line.split("share ")[1].split(" GiB")[0] for line in logs.splitlines() if "memory profile" in line})
    ok = summary["completed"] == len(prompts) and summary["failed"] == 0
    log(f"{'PASS' if ok else 'FAIL'} kvflow serve with default flags on one GPU: {summary['completed']}/{len(prompts)} "
        f"requests, worker shares {shares} GiB")
    record = {"workload": "serve_defaults_one_gpu_1p1d", "device": device_name(), "pass": ok,
              "completed": summary["completed"], "failed": summary["failed"], "errors": summary["errors"],
              "worker_memory_shares_gib": shares}
    write(out, "share", record)
    return record


def _first_gpu() -> str:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    return listed.split(",")[0] if listed else "0"


def part_headline(out: Path, log_dir: Path, model: list[str], rates: list[float], seconds_per_rate: float,
                  input_len: int, output_len: int) -> dict[str, Any]:
    configs = {
        "1p1d": ["--prefill-workers", "1", "--decode-workers", "1", "--kv-transfer-backend", "nccl",
                 *gpu_flags(("--prefill-gpus", [0]), ("--decode-gpus", [1]))],
        "2x_unified": ["--prefill-workers", "0", "--decode-workers", "2", *gpu_flags(("--decode-gpus", [0, 1]))],
    }
    sweeps: dict[str, list[dict[str, Any]]] = {}
    for name, flags in configs.items():
        serve = Serve([*model, "--max-model-len", str(input_len + output_len + 64), *flags], log_dir)
        try:
            serve.wait()
            # Warm-up at a low and a high rate: kernels meet the step shapes a sweep produces (mixed prefill and
            # decode batches on unified workers), the link is open.
            for n, rate in ((48, 8.0), (96, 16.0)):
                warm = make_prompts("random", n, input_len, 0, 0, seed=int(90 + rate), vocab=VOCAB[model[1]])
                bench_serve(serve.url, warm, output_len, rate, None)
            sweeps[name] = []
            for i, rate in enumerate(rates):
                prompts = make_prompts("random", max(8, int(rate * seconds_per_rate)), input_len, 0, 0, seed=100 + i,
                                       vocab=VOCAB[model[1]])
                summary = bench_serve(serve.url, prompts, output_len, rate, None, seed=i)
                summary["request_rate"] = rate
                sweeps[name].append(summary)
                if summary["errors"]:
                    log(f"errors: {summary['errors']}")
                log(f"{name} @ {rate:g} req/s: goodput {summary['request_goodput']:.2f} req/s (strict "
                    f"{summary['request_goodput_strict']:.2f}), TTFT p99 {summary['p99_ttft_ms']:.0f} ms, TPOT p99 "
                    f"{summary['p99_tpot_ms']:.1f} ms, out {summary['output_throughput']:.0f} tok/s, failed "
                    f"{summary['failed']}")
        finally:
            serve.stop()
        write(out, "headline_partial", sweeps)

    record = headline_record(sweeps, model[1], input_len, output_len, rates, seconds_per_rate)
    write(out, "headline", record)
    goodput, tpot = record["goodput_rps"], record["tpot_p99_s"]
    log(f"goodput (>= 90% within TTFT <= 1 s, TPOT <= 40 ms): 1P1D {goodput['1p1d']:.2f} vs 2x unified "
        f"{goodput['2x_unified']:.2f} req/s; TPOT p99 at {record['compared_at_rate']:g} req/s: "
        f"{tpot['1p1d'] * 1e3:.1f} vs {tpot['2x_unified'] * 1e3:.1f} ms")
    return record


def headline_record(sweeps: dict[str, list[dict[str, Any]]], model: str, input_len: int, output_len: int,
                    rates: list[float], seconds_per_rate: float, device: str | None = None) -> dict[str, Any]:
    """The headline record from the two configurations' sweeps (also rebuilt offline from a partial file)."""
    names = ("1p1d", "2x_unified")

    def at_rate(name: str, key: str) -> dict[str, float]:
        return {str(s["request_rate"]): s[key] for s in sweeps[name]}

    def row(name: str, rate: float) -> dict[str, Any]:
        return next(s for s in sweeps[name] if s["request_rate"] == rate)

    goodput = {name: attained_rate(sweeps[name], SLO) for name in names}
    strict = {name: attained_rate(sweeps[name], STRICT_SLO) for name in names}
    # TPOT compared at one rate: the highest both serve within the SLO (past it, both are saturated).
    both = [r for r in rates if all(attainment(row(n, r), SLO) >= ATTAINMENT for n in names)]
    common = max(both) if both else min(rates)
    tpot_p99 = {name: row(name, common)["p99_tpot_ms"] / 1e3 for name in names}
    ttft_p99 = {name: row(name, common)["p99_ttft_ms"] / 1e3 for name in names}
    return {
        "workload": f"pd_headline_{model}_{input_len}in_{output_len}out_poisson", "device": device or device_name(),
        "slo": {**SLO, "attainment": ATTAINMENT,
                "definition": "a request meets the SLO if its TTFT <= ttft_s and its mean TPOT <= tpot_s; goodput_rps "
                              "is the highest Poisson rate at which >= 90% of requests meet it (DistServe), "
                              "interpolated towards the next sweep point"},
        "goodput_rps": goodput,
        "goodput_ratio": goodput["1p1d"] / goodput["2x_unified"] if goodput["2x_unified"] else None,
        "strict_slo": STRICT_SLO, "goodput_rps_strict": strict,
        "vllm_request_goodput_rps": {n: max(s["request_goodput"] for s in sweeps[n]) for n in names},
        "slo_attainment_by_rate": {n: {str(s["request_rate"]): attainment(s, SLO) for s in sweeps[n]} for n in names},
        "tpot_p99_s": tpot_p99, "ttft_p99_s": ttft_p99, "compared_at_rate": common,
        "tpot_p99_ratio": tpot_p99["1p1d"] / tpot_p99["2x_unified"],
        "tpot_p99_ms_by_rate": {n: at_rate(n, "p99_tpot_ms") for n in names},
        "ttft_p99_ms_by_rate": {n: at_rate(n, "p99_ttft_ms") for n in names},
        "ttft_p50_ms_by_rate": {n: at_rate(n, "median_ttft_ms") for n in names},
        "output_tok_s_by_rate": {n: at_rate(n, "output_throughput") for n in names},
        "rates": rates, "seconds_per_rate": seconds_per_rate, "sweeps": sweeps,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=("check", "share", "transfer", "local", "headline"),
                        default=["check", "transfer", "local"])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ROOT / "bench" / "results")))
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rates", type=float, nargs="+", default=[12, 16, 20, 24])
    parser.add_argument("--seconds-per-rate", type=float, default=15.0)
    parser.add_argument("--smoke", action="store_true", help="tiny model, small sizes: the plumbing only")
    args = parser.parse_args()
    import torch

    gpus = torch.cuda.device_count() >= 2
    model = SMOKE_MODEL if args.smoke else MODEL
    local_shape = (32, 64, 16) if args.smoke else (256, 512, 128)
    headline_shape = (256, 32) if args.smoke else (2048, 256)
    if args.smoke:
        args.prompt_lens, args.reps, args.rates, args.seconds_per_rate = [64, 256], 1, [2.0], 3.0
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_dir = Path(tempfile.mkdtemp(prefix="pd-gpu-"))
    log(f"device {device_name()}; logs in {log_dir}")
    failures = []
    for part in args.parts:
        started = time.monotonic()
        try:
            if part == "check":
                if not part_check(args.out, gpus)["pass"]:
                    failures.append(part)
            elif part == "share":
                if not part_share(args.out, log_dir, model, 256 if args.smoke else 1024)["pass"]:
                    failures.append(part)
            elif part == "transfer":
                part_transfer(args.out, model, args.prompt_lens, args.reps, gpus)
            elif part == "local":
                part_local(args.out, log_dir, model, *local_shape)
            else:
                part_headline(args.out, log_dir, model, args.rates, args.seconds_per_rate, *headline_shape)
        except Exception as exc:  # report and go on to the next part: the lease is short
            failures.append(part)
            log(f"part {part} FAILED: {type(exc).__name__}: {exc}")
            for path in sorted(log_dir.rglob("*.log"))[-4:]:
                log(f"--- {path} ---\n" + path.read_text(errors="replace")[-2500:])
        log(f"part {part} took {time.monotonic() - started:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
