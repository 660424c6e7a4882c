#!/usr/bin/env python3
"""Tensor parallelism on two GPUs, checked and timed in one script (issue 12's benchmarks).

Parts (`--parts`, run in this order; each writes <out>/tp_<part>.json as soon as it finishes):
  check       token-exact: greedy ids of a tiny fp32 model at TP=2 equal TP=1's, with CUDA graphs (NCCL all-reduce
              captured) and eager (PASS/FAIL per mode)
  allreduce   NCCL all-reduce µs per call at decode message sizes (8-32 KB, and larger for context), eager (host
              timed, one call at a time) and inside a CUDA graph (100 calls captured, replayed)
  decode8b    Llama-3.1-8B shapes, bf16, batch-1 decode tok/s: TP1 vs TP2 (graphs), and TP2 eager
  tput8b      N x 512/128 (default 1000) offline throughput: TP2 vs two TP1 replicas (data parallel, one per GPU,
              run side by side; aggregate = the sum of the replicas' output tok/s)
  llama70b    Llama-3.1-70B shapes, bf16, TP2: batch-1 decode tok/s against the aggregate memory roofline (both
              GPUs' measured copy bandwidth over the bytes a decode step reads), and a short N x 512/128
              throughput with MFU (2 x params FLOPs per token over both GPUs' dense bf16 peak)

Every engine runs in its own subprocess (`--one`), so each configuration starts on clean GPUs. Batch-1 decode
tok/s is the slope between a short and a long generation of the same prompt (prefill and start-up cancel).
`--smoke` runs the same code paths on CPU at tiny shapes (gloo instead of NCCL, no graphs).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \\
        python3 bench/tp_gpu.py --out bench/results
"""

from __future__ import annotations

import argparse
import contextlib
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

PARTS = ("check", "allreduce", "decode8b", "tput8b", "llama70b")
ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
H200_BF16_DENSE_TFLOPS = 989.0  # per GPU (H100/H200 SXM spec sheet, dense)
GRAPH_SIZES = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512]
RESULT_TAG = "TP_GPU_RESULT "
for _key, _value in ENV.items():
    os.environ[_key] = _value  # every process this script starts inherits them


# ---- one engine per subprocess --------------------------------------------------------------------------------
def one(job: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration in this process: a `kind` of work on an engine built from `engine`."""
    import torch

    from kvflow import LLM, SamplingParams

    if job["kind"] == "allreduce":
        return allreduce_rank(job)
    if job["kind"] == "symm":
        try:
            return symm_allreduce_rank(job)
        except Exception as exc:  # noqa: BLE001 - an unavailable candidate is a result, not a crash
            return {"rank": job["rank"], "error": f"{type(exc).__name__}: {exc}"}
    if job.get("cuda_device") is not None:
        torch.cuda.set_device(job["cuda_device"])
    started = time.perf_counter()
    llm = LLM(**job["engine"])
    out: dict[str, Any] = {"load_s": round(time.perf_counter() - started, 1)}
    try:
        if "ids" in job:
            params = SamplingParams(temperature=0.0, max_tokens=job["ids"]["max_tokens"], ignore_eos=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in job["ids"]["prompts"]], params)
            out["ids"] = [o.outputs[0].token_ids for o in outs]
        if "decode" in job:
            out.update(batch1_decode(llm, **job["decode"]))
        if "tput" in job:
            out.update(throughput(llm, **job["tput"]))
        runner = llm.llm_engine.runner
        out["cuda_graphs"] = runner.graphs is not None
        out["num_kv_blocks"] = llm.llm_engine.num_gpu_blocks
    finally:
        llm.close()
    return out


def batch1_decode(llm: Any, short: int, long: int, prompt_len: int, repeats: int = 3) -> dict[str, Any]:
    """tok/s of one sequence's decode: (long - short) tokens over the extra time (best of `repeats`)."""
    from kvflow import SamplingParams

    prompt = {"prompt_token_ids": [(7 * i + 11) % 20000 + 10 for i in range(prompt_len)]}

    def timed(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompt, params)
        return time.perf_counter() - t0

    timed(short)  # warm-up
    best = min(timed(long) - timed(short) for _ in range(repeats))
    return {"decode_tok_s": round((long - short) / best, 2), "decode_ms_per_token": round(1000 * best / (long - short),
                                                                                           3)}


def throughput(llm: Any, num_prompts: int, input_len: int, output_len: int) -> dict[str, Any]:
    from kvflow import SamplingParams
    from kvflow.benchmarks.throughput import random_prompts

    vocab = llm.llm_engine.config.model.arch.vocab_size
    prompts = random_prompts(num_prompts, input_len, vocab, seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)
    llm.generate(prompts[: min(8, num_prompts)], SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - t0
    num_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tput_elapsed_s": round(elapsed, 2), "output_tok_s": round(num_out / elapsed, 1),
            "total_tok_s": round((num_out + num_prompts * input_len) / elapsed, 1), "num_prompts": num_prompts,
            "input_len": input_len, "output_len": output_len}


def allreduce_rank(job: dict[str, Any]) -> dict[str, Any]:
    """One rank of the all-reduce timing (the engine's own process group, engine/parallel/group.py)."""
    import torch

    from engine.parallel.group import TPGroup

    rank, size, cuda = job["rank"], job["size"], job["cuda"]
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    group = TPGroup("127.0.0.1", job["port"], rank, size, device, 60.0)
    dtype = torch.bfloat16 if cuda else torch.float32
    rows: list[dict[str, Any]] = []
    for nbytes in job["sizes"]:
        x = torch.ones(nbytes // dtype.itemsize, dtype=dtype, device=device)
        for _ in range(20):
            group.all_reduce(x)
        iters = job["iters"]
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(iters):
            group.all_reduce(x)
            if cuda:
                torch.cuda.synchronize()
        eager_us = (time.perf_counter() - t0) / iters * 1e6
        row = {"bytes": nbytes, "eager_us": round(eager_us, 2)}
        if cuda:
            graph = torch.cuda.CUDAGraph()
            calls = 100
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up on the capture stream
                group.all_reduce(x)
            torch.cuda.current_stream().wait_stream(stream)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    group.all_reduce(x)
            graph.replay()
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            replays = 10
            start.record()
            for _ in range(replays):
                graph.replay()
            end.record()
            torch.cuda.synchronize()
            row["graph_us"] = round(start.elapsed_time(end) * 1000 / (replays * calls), 2)
            single = torch.cuda.CUDAGraph()  # correctness of a captured all-reduce: ones sum to `size`
            with torch.cuda.graph(single):
                group.all_reduce(x)
            x.fill_(1.0)
            single.replay()
            torch.cuda.synchronize()
            row["graph_result_ok"] = bool(torch.all(x == float(size)).item())
        rows.append(row)
    group.close()
    return {"rank": rank, "rows": rows}


def symm_allreduce_rank(job: dict[str, Any]) -> dict[str, Any]:
    """The candidate small-message all-reduce: torch symmetric memory's one-shot all-reduce over peer memory
    (CUDA IPC; multicast disabled by TORCH_SYMM_MEM_DISABLE_MULTICAST=1), timed like NCCL. Measured only: the
    engine keeps NCCL unless this wins."""
    import torch
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem
    from torch._C._distributed_c10d import _SymmetricMemory

    from engine.parallel.group import TPGroup

    rank, size = job["rank"], job["size"]
    device = torch.device(f"cuda:{rank}")
    torch.cuda.set_device(device)
    group = TPGroup("127.0.0.1", job["port"], rank, size, device, 60.0)
    name = "kvflow-tp-symm"
    store = dist.PrefixStore("symm", group.store)
    # torch 2.11's symmetric-memory ops resolve the group by name in c10d's registry (set_group_info alone gave
    # "Could not resolve the process group registered under the name"): register a ProcessGroup over gloo too.
    pg = dist.ProcessGroup(store, rank, size)
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, gloo)
    torch._C._distributed_c10d._register_process_group(name, pg)
    with contextlib.suppress(Exception):  # older torch: the store-based group info is what it reads
        _SymmetricMemory.set_group_info(name, rank, size, store)
    rows: list[dict[str, Any]] = []
    for nbytes in job["sizes"]:
        buf = symm_mem.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
        symm_mem.rendezvous(buf, name)
        buf.fill_(1.0)
        out = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)
        torch.cuda.synchronize()
        row: dict[str, Any] = {"bytes": nbytes, "result_ok": bool(torch.all(out == float(size)).item())}
        for _ in range(20):
            torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(job["iters"]):
            torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)
            torch.cuda.synchronize()
        row["eager_us"] = round((time.perf_counter() - t0) / job["iters"] * 1e6, 2)
        graph, calls = torch.cuda.CUDAGraph(), 100
        with torch.cuda.graph(graph):
            for _ in range(calls):
                torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", name)
        graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        row["graph_us"] = round(start.elapsed_time(end) * 1000 / (10 * calls), 2)
        rows.append(row)
    group.close()
    return {"rank": rank, "rows": rows}


def run_jobs(jobs: list[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
    """Start each job as `tp_gpu.py --one JSON` side by side; their results, in order."""
    procs = []
    for job in jobs:
        procs.append(subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(job)],
                                      stdout=subprocess.PIPE, text=True, env={**os.environ, **ENV}, cwd=ROOT))
    results = []
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            stdout, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, _ = proc.communicate()
            results.append({"error": f"timed out after {timeout_s:.0f} s"})
            continue
        line = next((ln for ln in stdout.splitlines() if ln.startswith(RESULT_TAG)), None)
        results.append(json.loads(line[len(RESULT_TAG):]) if line else {"error": f"exit code {proc.returncode}"})
    return results


# ---- parts ----------------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.smoke = args.smoke
        self.cuda = torch.cuda.is_available() and not args.smoke
        if not self.smoke and torch.cuda.device_count() < 2:
            raise SystemExit("needs two GPUs (or --smoke on CPU)")
        self.device = torch.cuda.get_device_name(0) if self.cuda else "cpu"
        self.dtype = "bf16" if self.cuda else "fp32"
        self.out = args.out
        self.out.mkdir(parents=True, exist_ok=True)

    def engine(self, model: str, tp: int, **extra: Any) -> dict[str, Any]:
        base: dict[str, Any] = {"model": model, "load_format": "dummy", "tensor_parallel_size": tp}
        if self.smoke:
            base.update(device="cpu", kv_cache_memory_bytes=1 << 26, max_model_len=1024)
        else:
            base.update(dtype="bfloat16", gpu_memory_utilization=0.88, cudagraph_capture_sizes=GRAPH_SIZES)
        base.update(extra)
        return base

    def write(self, part: str, record: dict[str, Any]) -> None:
        record = {"part": part, "device": self.device, "smoke": self.smoke, **record}
        path = self.out / f"tp_{part}.json"
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(json.dumps(record), flush=True)

    def check(self) -> None:
        model = "tiny"
        prompts = [[1, 5, 9, 33, 7, 100], list(range(3, 60))]
        ids = {"prompts": prompts, "max_tokens": 24}
        fp32 = {"dtype": "float32", "gpu_memory_utilization": 0.3, "cudagraph_capture_sizes": [1, 2, 4]} \
            if self.cuda else {}
        jobs = [{"kind": "engine", "engine": self.engine(model, 1, enforce_eager=True, **fp32), "ids": ids}]
        modes = ["graphs", "eager"] if self.cuda else ["eager"]
        for mode in modes:
            jobs.append({"kind": "engine", "engine": self.engine(model, 2, enforce_eager=mode == "eager", **fp32),
                         "ids": ids})
        results = [r for job in jobs for r in run_jobs([job], 180)]
        base = results[0].get("ids")
        record: dict[str, Any] = {"workload": f"{model} fp32 greedy ids, TP2 vs TP1", "tp1_graphs":
                                  results[0].get("cuda_graphs")}
        for mode, res in zip(modes, results[1:], strict=True):
            record[f"tp2_{mode}"] = "PASS" if base is not None and res.get("ids") == base else \
                f"FAIL {res.get('error', '')}".strip()
            record[f"tp2_{mode}_cuda_graphs"] = res.get("cuda_graphs")
        self.write("check", record)

    def allreduce(self) -> None:
        from engine.parallel.executor import free_port

        sizes = [8 << 10, 16 << 10, 32 << 10, 64 << 10, 256 << 10, 1 << 20]
        port = free_port()
        iters = 20 if self.smoke else 200
        jobs = [{"kind": "allreduce", "rank": r, "size": 2, "port": port, "cuda": self.cuda, "sizes": sizes,
                 "iters": iters} for r in range(2)]
        results = run_jobs(jobs, 300)
        record: dict[str, Any] = {
            "workload": "NCCL all-reduce, 2 ranks, bf16" if self.cuda else "gloo all-reduce, 2 ranks, fp32 (smoke)",
            "backend": "nccl" if self.cuda else "gloo", "rows": results[0].get("rows", results[0]),
            "rank1": results[1].get("rows", results[1])}
        if self.cuda:  # the one-shot peer-memory candidate, in its own processes (a failure cannot hang NCCL's)
            port = free_port()
            symm = run_jobs([{**job, "kind": "symm", "port": port} for job in jobs], 180)
            record["symm_mem_one_shot"] = symm[0].get("rows", symm[0])
            record["symm_mem_one_shot_rank1"] = symm[1].get("rows", symm[1])
            record["engine_uses"] = "nccl"
        self.write("allreduce", record)

    def decode8b(self) -> None:
        model = "tiny" if self.smoke else "llama-3.1-8b"
        decode = {"short": 16, "long": 80 if self.smoke else 272, "prompt_len": 32, "repeats": 2}
        small = {} if self.smoke else {"max_model_len": 4096, "max_num_seqs": 8, "cudagraph_capture_sizes": [1, 2]}
        res = {}
        for name, engine in (("tp1", self.engine(model, 1, **small)), ("tp2", self.engine(model, 2, **small)),
                             ("tp2_eager", self.engine(model, 2, enforce_eager=True, **small))):
            res[name] = run_jobs([{"kind": "engine", "engine": engine, "decode": decode}], 600)[0]
        tp1, tp2 = res["tp1"].get("decode_tok_s"), res["tp2"].get("decode_tok_s")
        self.write("decode8b", {"workload": f"{model} {self.dtype} batch-1 decode ({decode['long'] - decode['short']} "
                                f"tokens after a {decode['prompt_len']}-token prompt)", "tp1": res["tp1"],
                                "tp2": res["tp2"], "tp2_eager": res["tp2_eager"],
                                "speedup_tp2_vs_tp1": round(tp2 / tp1, 3) if tp1 and tp2 else None})

    def tput8b(self) -> None:
        model = "tiny" if self.smoke else "llama-3.1-8b"
        n = self.args.num_prompts if not self.smoke else 16
        io = {"input_len": 512 if not self.smoke else 64, "output_len": 128 if not self.smoke else 16}
        limits = {} if self.smoke else {"max_model_len": 4096}
        tp2 = run_jobs([{"kind": "engine", "engine": self.engine(model, 2, **limits),
                         "tput": {"num_prompts": n, **io}}], 600)[0]
        replica_args = [{"device": "cuda:0"}, {"device": "cuda:1"}] if self.cuda else [{}, {}]
        halves = [n - n // 2, n // 2]
        dp = run_jobs([{"kind": "engine", "engine": self.engine(model, 1, **dev, **limits),
                        "tput": {"num_prompts": half, **io}} for dev, half in zip(replica_args, halves, strict=True)],
                      600)
        dp_tok_s = sum(r.get("output_tok_s", 0.0) for r in dp) if all("output_tok_s" in r for r in dp) else None
        self.write("tput8b", {"workload": f"{model} {self.dtype}, {n} x {io['input_len']}/{io['output_len']} offline",
                              "tp2": tp2, "dp2_replicas": dp, "dp2_output_tok_s": dp_tok_s,
                              "tp2_over_dp2": round(tp2["output_tok_s"] / dp_tok_s, 3)
                              if dp_tok_s and "output_tok_s" in tp2 else None})

    def llama70b(self) -> None:
        model = "tiny-qwen3" if self.smoke else "llama-3.1-70b"
        decode = {"short": 8, "long": 40 if self.smoke else 136, "prompt_len": 32, "repeats": 2}
        n = 16 if self.smoke else self.args.num_prompts_70b
        tput = {"num_prompts": n, "input_len": 64 if self.smoke else 512, "output_len": 16 if self.smoke else 128}
        extra = {} if self.smoke else {"max_model_len": 4096, "gpu_memory_utilization": 0.92}
        res = run_jobs([{"kind": "engine", "engine": self.engine(model, 2, **extra), "decode": decode,
                         "tput": tput}], 900)[0]
        record: dict[str, Any] = {"workload": f"{model} {self.dtype} TP2: batch-1 decode, {n} x {tput['input_len']}/"
                                  f"{tput['output_len']} throughput", "tp2": res}
        from engine.models.loader import resolve_model

        arch = resolve_model(model, "dummy").arch
        weight_bytes = arch.num_params * (4 if self.smoke else 2)
        bw = copy_bandwidth_gbps(2) if self.cuda else None
        record.update(params=arch.num_params, weight_bytes=weight_bytes, copy_gbps_per_gpu=bw)
        if bw and "decode_tok_s" in res:
            kv_bytes = arch.kv_bytes_per_token(2) * (decode["prompt_len"] + decode["long"] // 2)
            roofline = sum(bw) * 1e9 / (weight_bytes + kv_bytes)  # both GPUs stream their halves at once
            record.update(roofline_tok_s=round(roofline, 1),
                          decode_share_of_roofline=round(res["decode_tok_s"] / roofline, 3))
        if self.cuda and "total_tok_s" in res:
            flops = 2 * arch.num_params * res["total_tok_s"]
            record["mfu"] = round(flops / (2 * H200_BF16_DENSE_TFLOPS * 1e12), 4)
            record["mfu_peak_assumed_tflops_per_gpu"] = H200_BF16_DENSE_TFLOPS
        self.write("llama70b", record)


def copy_bandwidth_gbps(num_gpus: int) -> list[float]:
    """Each GPU's device-to-device copy bandwidth (read + write bytes per second / 2: the bytes read), GB/s."""
    import torch

    out = []
    for index in range(num_gpus):
        device = torch.device(f"cuda:{index}")
        src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        for _ in range(3):
            dst.copy_(src)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(device):
            start.record()
            for _ in range(20):
                dst.copy_(src)
            end.record()
            torch.cuda.synchronize(device)
        seconds = start.elapsed_time(end) / 1000 / 20
        out.append(round(2 * src.numel() / seconds / 1e9, 1))  # read + write traffic, as a roofline counts bytes
        del src, dst
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the same code paths")
    parser.add_argument("--num-prompts", type=int, default=1000, help="tput8b prompts (512 in / 128 out)")
    parser.add_argument("--num-prompts-70b", type=int, default=200, help="llama70b throughput prompts")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        import logging

        logging.basicConfig(level=logging.WARNING)
        print(RESULT_TAG + json.dumps(one(json.loads(args.one))), flush=True)
        return
    started = time.perf_counter()
    bench = Bench(args)
    for part in PARTS:
        if part in args.parts:
            t0 = time.perf_counter()
            getattr(bench, part)()
            print(f"part {part}: {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    print(f"all parts: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
