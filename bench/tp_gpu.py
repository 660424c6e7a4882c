"""Tensor parallelism on two GPUs, checked and timed in one scenario (issue 12's benchmarks).

Parts (`--parts`, run in this order; each writes <out>/tp_<part>.json as soon as it finishes):
  check       token-exact: greedy and seeded-sampled ids of a tiny fp32 model at TP=2 equal TP=1 eager's, with CUDA
              graphs (the default peer one-shot, and NCCL by --disable-custom-all-reduce), eager, and TP1 in graphs
  allreduce   all-reduce µs per call at 8 KB-4 MB, eager and inside a CUDA graph (100 calls replayed): NCCL and the
              peer one-shot (engine/parallel/peer_all_reduce.py) at 32 / 64 / 128 programs; every size checked on
              random inputs, and a graph of mixed sizes replayed 50 times on fresh inputs
  decode8b    Llama-3.1-8B shapes, bf16, batch-1 decode tok/s: TP1 vs TP2 (graphs; one-shot and NCCL), TP2 eager
  tput8b      N x 512/128 (default 1000) offline throughput: TP2 vs two TP1 replicas side by side (their sum)
  profile8b   where TP2's throughput goes: TP2 on N x 512/128 (default 300) vs one TP1 GPU on half of them, rank 0
              under torch.profiler (CUDA kernels only): per step the host seconds and make-up; per engine kernel
              busy and idle time, top kernels and classes; chrome traces beside the record
  llama70b    Llama-3.1-70B shapes, bf16, TP2: batch-1 decode against the memory roofline (both GPUs' copy
              bandwidth over a step's bytes), and N x 512/128 throughput with MFU

`--ranks 4` (or 8) runs check and allreduce at that TP size, into tp_check_tp4.json / tp_allreduce_tp4.json: at TP4
the one-shot is the default (graphs, eager; graphs_nccl asks for NCCL); at TP8 the check asks for it by name
(graphs_peer, eager_peer) beside the default NCCL (graphs).

Every engine runs in its own subprocess (bench/harness/jobs.py), so each configuration starts on clean GPUs.
Batch-1 decode tok/s is the slope between a short and a long generation of the same prompt (prefill and start-up
cancel). `--smoke` runs the same code paths on CPU at tiny shapes (gloo instead of NCCL, no graphs).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \\
        python -m bench.tp_gpu --out bench/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness.jobs import MULTICAST_OFF, answer_job, run_jobs
from bench.harness.records import RESULTS, write_json
from bench.harness.runs import output_tokens, timed_generate

PARTS = ("check", "allreduce", "decode8b", "tput8b", "profile8b", "llama70b")
H200_BF16_DENSE_TFLOPS = 989.0  # per GPU (H100/H200 SXM spec sheet, dense)
GRAPH_SIZES = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512]
MODULE = "bench.tp_gpu"


# ---- one job per subprocess -----------------------------------------------------------------------------------
def one(job: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration in this process: an all-reduce rank, or work on an engine built from `engine`."""
    if job["kind"] == "allreduce":
        return allreduce_rank(job)
    return engine_job(job)


def engine_job(job: dict[str, Any]) -> dict[str, Any]:
    import torch

    from kvflow import LLM, SamplingParams

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
            # seeded sampling (temperature 1, top-p 0.9): decode-ahead replays queued for sampled batches too
            sampled = [SamplingParams(temperature=1.0, top_p=0.9, seed=i, max_tokens=job["ids"]["max_tokens"],
                                      ignore_eos=True) for i in range(len(job["ids"]["prompts"]))]
            outs = llm.generate([{"prompt_token_ids": p} for p in job["ids"]["prompts"]], sampled)
            out["sampled_ids"] = [o.outputs[0].token_ids for o in outs]
            ahead = llm.llm_engine.runner.decode_ahead
            out["decode_ahead"] = {"hits": ahead.hits, "partial_hits": ahead.partial_hits, "misses": ahead.misses}
        if "decode" in job:
            out.update(batch1_decode(llm, **job["decode"]))
        if "tput" in job:
            out.update(throughput(llm, **job["tput"]))
        if "profile" in job:
            out.update(profiled_throughput(llm, **job["profile"]))
        out["cuda_graphs"] = llm.llm_engine.runner.graphs is not None
        out["all_reduce"] = llm.llm_engine.runner.all_reduce_kind
        out["num_kv_blocks"] = llm.llm_engine.num_gpu_blocks
    finally:
        llm.close()
    return out


def batch1_decode(llm: Any, short: int, long: int, prompt_len: int, repeats: int = 3) -> dict[str, Any]:
    """tok/s of one sequence's decode: (long - short) tokens over the extra time (best of `repeats`)."""
    from kvflow import SamplingParams

    prompt = {"prompt_token_ids": [(7 * i + 11) % 20000 + 10 for i in range(prompt_len)]}

    def timed(n: int) -> float:
        return timed_generate(llm, prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))[1]

    timed(short)  # warm-up
    best = min(timed(long) - timed(short) for _ in range(repeats))
    return {"decode_tok_s": round((long - short) / best, 2),
            "decode_ms_per_token": round(1000 * best / (long - short), 3)}


def warmed_prompts(llm: Any, num_prompts: int, input_len: int, output_len: int) -> tuple[list[Any], Any]:
    """The throughput load (random prompts, seed 0; sampled at temperature 1.0 to `output_len`) after a short
    warm-up generate of its first prompts: (prompts, sampling params)."""
    from kvflow import SamplingParams
    from kvflow.benchmarks.throughput import random_prompts

    prompts = random_prompts(num_prompts, input_len, llm.llm_engine.config.model.arch.vocab_size, seed=0)
    llm.generate(prompts[: min(8, num_prompts)], SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True))
    return prompts, SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True)


def throughput(llm: Any, num_prompts: int, input_len: int, output_len: int) -> dict[str, Any]:
    prompts, params = warmed_prompts(llm, num_prompts, input_len, output_len)
    outs, elapsed = timed_generate(llm, prompts, params)
    num_out = output_tokens(outs)
    return {"tput_elapsed_s": round(elapsed, 2), "output_tok_s": round(num_out / elapsed, 1),
            "total_tok_s": round((num_out + num_prompts * input_len) / elapsed, 1), "num_prompts": num_prompts,
            "input_len": input_len, "output_len": output_len}


def profiled_throughput(llm: Any, num_prompts: int, input_len: int, output_len: int, trace: str) -> dict[str, Any]:
    """`throughput` with each engine step timed on the host and rank 0's GPU kernels recorded (CUDA activity only:
    no per-op host events, which would slow the host this measures); the chrome trace goes to `trace` (.gz)."""
    import gzip
    import shutil

    import torch
    from torch.profiler import ProfilerActivity, profile

    prompts, params = warmed_prompts(llm, num_prompts, input_len, output_len)
    runner = llm.llm_engine.runner
    inner = runner.execute_model
    steps: list[tuple[int, int, int, float]] = []

    def timed_step(so: Any) -> Any:  # the bench's own wrapper on this instance: the engine is not changed
        started = time.perf_counter()
        try:
            return inner(so)
        finally:
            steps.append((so.total_num_scheduled_tokens, so.num_decode_seqs, so.num_prefill_tokens,
                          time.perf_counter() - started))

    cuda = torch.cuda.is_available()  # --smoke on CPU: host ops only, so no kernels to summarize
    runner.execute_model = timed_step
    try:
        with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
            outs, elapsed = timed_generate(llm, prompts, params)
    finally:
        runner.execute_model = inner
    raw = trace.removesuffix(".gz")
    prof.export_chrome_trace(raw)
    with open(raw, "rb") as src, gzip.open(trace, "wb") as dst:
        shutil.copyfileobj(src, dst)
    with open(raw) as handle:
        kernels = [e for e in json.load(handle).get("traceEvents", []) if e.get("cat") == "kernel"]
    os.remove(raw)
    return {"tput_elapsed_s": round(elapsed, 2), "output_tok_s": round(output_tokens(outs) / elapsed, 1),
            "num_prompts": num_prompts, "steps": step_summary(steps), "kernels": kernel_summary(kernels),
            "trace": os.path.basename(trace)}


def step_summary(steps: list[tuple[int, int, int, float]]) -> dict[str, Any]:
    """Host seconds in the runner, split into steps that carry prompt tokens ("mixed") and pure decode steps."""
    out: dict[str, Any] = {}
    for kind, chosen in (("mixed", [s for s in steps if s[2] > 0]), ("decode", [s for s in steps if s[2] == 0])):
        seconds = sum(s[3] for s in chosen)
        out[kind] = {"steps": len(chosen), "seconds": round(seconds, 3),
                     "mean_ms": round(1e3 * seconds / len(chosen), 2) if chosen else None,
                     "mean_tokens": round(sum(s[0] for s in chosen) / len(chosen), 1) if chosen else None,
                     "max_ms": round(1e3 * max(s[3] for s in chosen), 2) if chosen else None}
    out["first_mixed_steps_ms"] = [round(1e3 * s[3], 1) for s in steps if s[2] > 0][:12]
    return out


KERNEL_CLASSES = (("all_reduce_nccl", ("nccl",)), ("all_reduce_peer", ("peer_all_reduce",)),
                  ("attention", ("attention", "attn")), ("gemm", ("gemm", "nvjet", "sm90", "cutlass", "cublas")),
                  ("norm_rotary_act", ("norm", "rotary", "silu", "act_and_mul")), ("sampling", ("sampl", "argmax",
                  "softmax", "topk", "sort", "multinomial", "exponential")))


def kernel_summary(kernels: list[dict[str, Any]], top: int = 25) -> dict[str, Any]:
    """Busy time (the union of kernel intervals), idle time inside the span, per-class and top kernels (µs)."""
    if not kernels:
        return {"count": 0}
    spans = sorted((float(k["ts"]), float(k["ts"]) + float(k.get("dur", 0.0))) for k in kernels)
    busy, end = 0.0, spans[0][0]
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    totals: dict[str, list[float]] = {}
    for k in kernels:
        entry = totals.setdefault(k["name"], [0.0, 0])
        entry[0] += float(k.get("dur", 0.0))
        entry[1] += 1
    classes: dict[str, float] = {}
    for name, (dur, _) in totals.items():
        low = name.lower()
        kind = next((c for c, keys in KERNEL_CLASSES if any(key in low for key in keys)), "other")
        classes[kind] = classes.get(kind, 0.0) + dur
    ranked = sorted(totals.items(), key=lambda item: -item[1][0])[:top]
    span = spans[-1][1] - spans[0][0]
    return {"count": len(kernels), "span_ms": round(span / 1e3, 1), "busy_ms": round(busy / 1e3, 1),
            "idle_ms": round((span - busy) / 1e3, 1), "class_ms": {c: round(v / 1e3, 1) for c, v in
                                                                  sorted(classes.items(), key=lambda i: -i[1])},
            "top": [{"name": name[:160], "ms": round(dur / 1e3, 2), "calls": calls}
                    for name, (dur, calls) in ranked]}


def call_us(call: Callable[[], Any], iters: int, cuda: bool) -> dict[str, float]:
    """µs per call: eager (host-timed, synchronized after each call, after 20 warm-ups) and, on CUDA, from 100
    calls captured in a graph and replayed 10 times."""
    import torch

    from bench.harness.timing import capture_graph, cuda_event_mean_seconds

    for _ in range(20):
        call()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
        if cuda:
            torch.cuda.synchronize()
    out = {"eager_us": round((time.perf_counter() - t0) / iters * 1e6, 2)}
    if cuda:
        graph = capture_graph(lambda: [call() for _ in range(100)])
        out["graph_us"] = round(cuda_event_mean_seconds(graph.replay, 10, warmup=1) * 1e6 / 100, 2)
    return out


def allreduce_rank(job: dict[str, Any]) -> dict[str, Any]:
    """One rank of the all-reduce timing (the engine's own process group, engine/parallel/group.py): NCCL, then
    on GPUs the peer-memory one-shot (engine/parallel/peer_all_reduce.py) with each `programs` variant, its
    threshold raised to the largest size so the crossover shows. Every size is also checked on random data:
    eagerly, and replayed from a graph of mixed sizes with fresh inputs before each replay."""
    import torch
    import torch.distributed as dist

    from engine.parallel.group import TPGroup
    from engine.parallel.peer_all_reduce import PeerAllReduce

    rank, size, cuda = job["rank"], job["size"], job["cuda"]
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    group = TPGroup("127.0.0.1", job["port"], rank, size, device, 60.0)
    dtype = torch.bfloat16 if cuda else torch.float32
    out: dict[str, Any] = {"rank": rank, "nccl" if cuda else "gloo": time_sizes(group.all_reduce, job, device, dtype)}
    for programs in job.get("peer_programs", []) if cuda else []:
        store = dist.PrefixStore(f"bench-peer-{programs}", group.store)
        peer, why = PeerAllReduce.setup(store, rank, size, device, 10.0, max_bytes=max(job["sizes"]),
                                        programs=programs)
        if peer is None:
            out[f"peer_p{programs}"] = {"error": why}
            continue
        out[f"peer_p{programs}"] = {"describe": peer.describe(), "rows": time_sizes(peer, job, device, dtype),
                                    "graph_mixed_sizes_ok": mixed_graph_ok(peer, rank, size, device, dtype),
                                    "gave_up_waiting": peer.failed()}
        torch.cuda.synchronize()
        peer.close()
    group.close()
    return out


def rank_inputs(numel: int, size: int, seed: int, device: Any, dtype: Any) -> list[Any]:
    """Every rank's input for one check (each rank draws all of them from the same seeds)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen).to(device, dtype) for _ in range(size)]


def time_sizes(reduce: Callable[[Any], Any], job: dict[str, Any], device: Any, dtype: Any) -> list[dict[str, Any]]:
    """µs per call at each size, and the sum of random inputs checked against the fp32 sum in rank order: `exact`
    where every bit matches, else the largest error relative to the largest magnitude."""
    import torch

    rank, size, cuda = job["rank"], job["size"], job["cuda"]
    rows = []
    for index, nbytes in enumerate(job["sizes"]):
        x = torch.randn(nbytes // dtype.itemsize, device=device).to(dtype)
        row: dict[str, Any] = {"bytes": nbytes, **call_us(lambda x=x: reduce(x), job["iters"], cuda)}
        inputs = rank_inputs(x.numel(), size, 1000 + index, device, dtype)
        want = torch.stack([t.float() for t in inputs]).sum(0)
        x.copy_(inputs[rank])
        reduce(x)
        if cuda:
            torch.cuda.synchronize()
        row["exact"] = bool(torch.equal(x, want.to(dtype)))
        row["max_rel_err"] = float((x.float() - want).abs().max() / want.abs().max())
        rows.append(row)
    return rows


def mixed_graph_ok(reduce: Callable[[Any], Any], rank: int, size: int, device: Any, dtype: Any,
                   replays: int = 50) -> bool:
    """A graph of three all-reduces of different sizes (8 KB, 64 KB, 8 KB) replayed `replays` times, with fresh
    random inputs before each replay: every result bit-exact (the epochs and buffer halves stay in step)."""
    import torch

    from bench.harness.timing import capture_graph

    elems = [4096, 32768, 4096]
    xs = [torch.zeros(n, dtype=dtype, device=device) for n in elems]
    graph = capture_graph(lambda: [reduce(x) for x in xs])
    ok = True
    for replay in range(replays):
        wants = []
        for index, (x, n) in enumerate(zip(xs, elems, strict=True)):
            inputs = rank_inputs(n, size, 7 * replay + index, device, dtype)
            x.copy_(inputs[rank])
            wants.append(torch.stack([t.float() for t in inputs]).sum(0).to(dtype))
        graph.replay()
        torch.cuda.synchronize()
        ok = ok and all(torch.equal(x, want) for x, want in zip(xs, wants, strict=True))
    return ok


# ---- parts ----------------------------------------------------------------------------------------------------
class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        self.args = args
        self.smoke = args.smoke
        self.cuda = torch.cuda.is_available() and not args.smoke
        self.ranks = args.ranks  # check / allreduce: the TP size (the one-shot is the default at 2 and 4)
        if not self.smoke and torch.cuda.device_count() < max(2, self.ranks):
            raise SystemExit(f"needs {max(2, self.ranks)} GPUs (or --smoke on CPU)")
        self.device = torch.cuda.get_device_name(0) if self.cuda else "cpu"
        self.dtype = "bf16" if self.cuda else "fp32"

    def engine(self, model: str, tp: int, **extra: Any) -> dict[str, Any]:
        base: dict[str, Any] = {"model": model, "load_format": "dummy", "tensor_parallel_size": tp}
        if self.smoke:
            base.update(device="cpu", kv_cache_memory_bytes=1 << 26, max_model_len=1024)
        else:
            base.update(dtype="bfloat16", gpu_memory_utilization=0.88, cudagraph_capture_sizes=GRAPH_SIZES)
        return {**base, **extra}

    def jobs(self, jobs: list[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
        return run_jobs(MODULE, jobs, timeout_s, MULTICAST_OFF)

    def write(self, part: str, record: dict[str, Any]) -> None:
        record = {"part": part, "device": self.device, "smoke": self.smoke, **record}
        write_json(self.args.out / f"tp_{part}.json", record)
        print(json.dumps(record), flush=True)

    def check(self) -> None:
        prompts = [[1, 5, 9, 33, 7, 100], list(range(3, 60))]
        ids = {"prompts": prompts, "max_tokens": 24}
        fp32 = {"dtype": "float32", "gpu_memory_utilization": 0.3, "cudagraph_capture_sizes": [1, 2, 4]} \
            if self.cuda else {}
        tp = self.ranks
        # TP2's and TP4's default all-reduce is the peer one-shot (NCCL asked for by name); other sizes default to
        # NCCL and ask for the one-shot by name
        modes = (["graphs", "eager", "graphs_nccl"] if tp in (2, 4) else ["graphs_peer", "eager_peer", "graphs"]) \
            if self.cuda else ["eager"]
        jobs = [{"kind": "engine", "engine": self.engine("tiny", 1, enforce_eager=True, **fp32), "ids": ids}]
        jobs += [{"kind": "engine", "engine": self.engine("tiny", tp, enforce_eager=mode.startswith("eager"),
                                                          disable_custom_all_reduce=mode.endswith("nccl"),
                                                          enable_custom_all_reduce=mode.endswith("peer"), **fp32),
                  "ids": ids} for mode in modes]
        if self.cuda:  # TP1 in graphs: decode-ahead without tensor parallelism
            jobs.append({"kind": "engine", "engine": self.engine("tiny", 1, **fp32), "ids": ids})
        results = [r for job in jobs for r in self.jobs([job], 180)]
        base = results[0].get("ids")
        record: dict[str, Any] = {"workload": f"tiny fp32 greedy and seeded-sampled ids, TP{tp} vs TP1 eager",
                                  "tp1_graphs": results[0].get("cuda_graphs")}
        base_sampled = results[0].get("sampled_ids")
        for mode, res in zip(modes, results[1 : 1 + len(modes)], strict=True):
            record[f"tp{tp}_{mode}"] = "PASS" if base is not None and res.get("ids") == base else \
                f"FAIL {res.get('error', '')}".strip()
            record[f"tp{tp}_{mode}_sampled"] = "PASS" if base_sampled is not None and \
                res.get("sampled_ids") == base_sampled else "FAIL"
            record[f"tp{tp}_{mode}_decode_ahead"] = res.get("decode_ahead")
            record[f"tp{tp}_{mode}_cuda_graphs"] = res.get("cuda_graphs")
            record[f"tp{tp}_{mode}_all_reduce"] = res.get("all_reduce")
        if self.cuda:
            tp1 = results[-1]
            record["tp1_graphs_vs_eager"] = "PASS" if tp1.get("ids") == base else f"FAIL {tp1.get('error', '')}"
            record["tp1_graphs_vs_eager_sampled"] = "PASS" if tp1.get("sampled_ids") == base_sampled else "FAIL"
            record["tp1_graphs_decode_ahead"] = tp1.get("decode_ahead")
        self.write("check" if tp == 2 else f"check_tp{tp}", record)

    def allreduce(self) -> None:
        from engine.parallel.executor import free_port

        sizes = [8 << 10, 16 << 10, 32 << 10, 64 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20]
        port = free_port()
        ranks = self.ranks
        jobs = [{"kind": "allreduce", "rank": r, "size": ranks, "port": port, "cuda": self.cuda, "sizes": sizes,
                 "iters": 20 if self.smoke else 200, "peer_programs": [32, 64, 128]} for r in range(ranks)]
        results = self.jobs(jobs, 300)
        record: dict[str, Any] = {
            "workload": f"all-reduce, {ranks} ranks, bf16, random inputs: NCCL and the peer-memory one-shot "
                        "(programs 32 / 64 / 128)" if self.cuda else f"gloo all-reduce, {ranks} ranks, fp32 (smoke)",
            "backend": "nccl" if self.cuda else "gloo", **{f"rank{r}": res for r, res in enumerate(results)}}
        if self.cuda:
            from engine.parallel.peer_all_reduce import DEFAULT_PROGRAMS, default_max_bytes

            record["engine_uses"] = f"at TP{ranks} the peer one-shot (programs {DEFAULT_PROGRAMS}) up to " \
                                    f"{default_max_bytes(ranks)} bytes, NCCL above" + \
                                    ("" if ranks in (2, 4) else " when asked for") + \
                                    "; NCCL with --disable-custom-all-reduce"
        self.write("allreduce" if ranks == 2 else f"allreduce_tp{ranks}", record)

    def decode8b(self) -> None:
        model = "tiny" if self.smoke else "llama-3.1-8b"
        decode = {"short": 16, "long": 80 if self.smoke else 272, "prompt_len": 32, "repeats": 2}
        small = {} if self.smoke else {"max_model_len": 4096, "max_num_seqs": 8, "cudagraph_capture_sizes": [1, 2]}
        engines = {"tp1": self.engine(model, 1, **small), "tp2": self.engine(model, 2, **small),
                   "tp2_nccl": self.engine(model, 2, disable_custom_all_reduce=True, **small),
                   "tp2_eager": self.engine(model, 2, enforce_eager=True, **small)}
        res = {name: self.jobs([{"kind": "engine", "engine": e, "decode": decode}], 600)[0]
               for name, e in engines.items()}
        tp1, tp2 = res["tp1"].get("decode_tok_s"), res["tp2"].get("decode_tok_s")
        self.write("decode8b", {"workload": f"{model} {self.dtype} batch-1 decode ({decode['long'] - decode['short']} "
                                f"tokens after a {decode['prompt_len']}-token prompt)", **res,
                                "speedup_tp2_vs_tp1": round(tp2 / tp1, 3) if tp1 and tp2 else None,
                                "speedup_tp2_nccl_vs_tp1": round(res["tp2_nccl"]["decode_tok_s"] / tp1, 3)
                                if tp1 and res["tp2_nccl"].get("decode_tok_s") else None})

    def tput8b(self) -> None:
        model = "tiny" if self.smoke else "llama-3.1-8b"
        n = self.args.num_prompts if not self.smoke else 16
        io = {"input_len": 512 if not self.smoke else 64, "output_len": 128 if not self.smoke else 16}
        limits = {} if self.smoke else {"max_model_len": 4096}
        tp2 = self.jobs([{"kind": "engine", "engine": self.engine(model, 2, **limits),
                          "tput": {"num_prompts": n, **io}}], 600)[0]
        replica_args = [{"device": "cuda:0"}, {"device": "cuda:1"}] if self.cuda else [{}, {}]
        dp = self.jobs([{"kind": "engine", "engine": self.engine(model, 1, **dev, **limits),
                         "tput": {"num_prompts": half, **io}}
                        for dev, half in zip(replica_args, [n - n // 2, n // 2], strict=True)], 600)
        dp_tok_s = sum(r.get("output_tok_s", 0.0) for r in dp) if all("output_tok_s" in r for r in dp) else None
        self.write("tput8b", {"workload": f"{model} {self.dtype}, {n} x {io['input_len']}/{io['output_len']} offline",
                              "tp2": tp2, "dp2_replicas": dp, "dp2_output_tok_s": dp_tok_s,
                              "tp2_over_dp2": round(tp2["output_tok_s"] / dp_tok_s, 3)
                              if dp_tok_s and "output_tok_s" in tp2 else None})

    def profile8b(self) -> None:
        model = "tiny" if self.smoke else "llama-3.1-8b"
        n = 16 if self.smoke else self.args.num_prompts_profile
        io = {"input_len": 512 if not self.smoke else 64, "output_len": 128 if not self.smoke else 16}
        limits = {} if self.smoke else {"max_model_len": 4096}
        self.args.out.mkdir(parents=True, exist_ok=True)
        engines = {"tp2": (self.engine(model, 2, **limits), n), "tp1": (self.engine(model, 1, **limits), n // 2)}
        record: dict[str, Any] = {"workload": f"{model} {self.dtype}: TP2 on {n} x {io['input_len']}/"
                                  f"{io['output_len']} vs TP1 on {n // 2}, temperature 1.0, rank 0 profiled"}
        for name, (engine, prompts) in engines.items():
            trace = str((self.args.out / f"tp_profile8b_{name}.trace.json.gz").resolve())
            record[name] = self.jobs([{"kind": "engine", "engine": engine,
                                       "profile": {"num_prompts": prompts, **io, "trace": trace}}], 600)[0]
        self.write("profile8b", record)

    def llama70b(self) -> None:
        from engine.models.loader import resolve_model

        model = "tiny-qwen3" if self.smoke else "llama-3.1-70b"
        decode = {"short": 8, "long": 40 if self.smoke else 136, "prompt_len": 32, "repeats": 2}
        n = 16 if self.smoke else self.args.num_prompts_70b
        tput = {"num_prompts": n, "input_len": 64 if self.smoke else 512, "output_len": 16 if self.smoke else 128}
        extra = {} if self.smoke else {"max_model_len": 4096, "gpu_memory_utilization": 0.92}
        res = self.jobs([{"kind": "engine", "engine": self.engine(model, 2, **extra), "decode": decode,
                          "tput": tput}], 900)[0]
        record: dict[str, Any] = {"workload": f"{model} {self.dtype} TP2: batch-1 decode, {n} x {tput['input_len']}/"
                                  f"{tput['output_len']} throughput", "tp2": res}
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
            record["mfu"] = round(2 * arch.num_params * res["total_tok_s"] / (2 * H200_BF16_DENSE_TFLOPS * 1e12), 4)
            record["mfu_peak_assumed_tflops_per_gpu"] = H200_BF16_DENSE_TFLOPS
        self.write("llama70b", record)


def copy_bandwidth_gbps(num_gpus: int) -> list[float]:
    """Each GPU's device-to-device copy bandwidth (read + write bytes, as a roofline counts them), GB/s."""
    import torch

    from bench.harness.ceilings import copy_bytes_per_s
    from bench.harness.timing import cuda_event_mean_seconds

    out = []
    for index in range(num_gpus):
        with torch.cuda.device(index):
            src = torch.empty(1 << 30, dtype=torch.uint8, device=f"cuda:{index}")
            out.append(round(copy_bytes_per_s(src, lambda fn: cuda_event_mean_seconds(fn, 20, warmup=3)) / 1e9, 1))
            del src
            torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the same code paths")
    parser.add_argument("--num-prompts", type=int, default=1000, help="tput8b prompts (512 in / 128 out)")
    parser.add_argument("--num-prompts-70b", type=int, default=200, help="llama70b throughput prompts")
    parser.add_argument("--num-prompts-profile", type=int, default=300, help="profile8b's TP2 prompts (TP1: half)")
    parser.add_argument("--ranks", type=int, default=2, choices=(2, 4, 8),
                        help="check / allreduce: the TP size (files tp_check_tp<N>.json, tp_allreduce_tp<N>.json "
                             "when not 2); the other parts are two-GPU measurements")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        answer_job(args.one, one)
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
