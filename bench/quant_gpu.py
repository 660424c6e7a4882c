"""Quantization on the GPU (issues 14 and 32), each quantized form beside bf16 in the same run, Llama-3.1-8B shapes
with random weights (`--load-format dummy`):

- e2e:   the engine end to end (issue 32): modes bf16, fp8 (W8A8), int4 (the dummy AWQ preset), int4_fp8kv
         (+ fp8 KV) and gguf (a dummy GGUF written at load: Q4_1 linears, Q8_0 head), at batch 1, 16 and "tput"
         (N x 512 in / 128 out, default N=1000, --num-prompts), each
         (mode, batch) in a fresh process (bench/harness/jobs.py): first_batch_out_tok_s is its first generate
         after the engine is ready, out_tok_s a later repeat. Plus the check: greedy ids of int4 vs the dense
         checkpoint of the same weights, fp32 and bf16 (2-layer Llama-8B widths); with gguf among the modes, also
         the dummy GGUF engine vs HF transformers (fp32) on its dequantized weights (`gguf_check`). Writes
         bench/results/quant_e2e_<device>.json after every job; a later call with other --modes / --batches adds
         its records to the file's. Not run unless named in --parts.
- kv:    paged decode attention, bf16 KV vs fp8 KV, at 8k and 32k context (batch 1 and 16), checked against the
         torch reference; and the block count of each KV dtype in one budget.
- int4:  the decode step's weight GEMMs, int4 vs bf16 (bench/quant_int4.py).
- mma:   the same step with AWQ-shaped weights through the tensor-core int4 kernel (kernels/quant_mma_kn.py), tiles
         swept per batch, beside bf16 and the kn GEMV / GEMM (bench/quant_int4.py's part_mma).
- profile: batch-1 decode of the bf16 and int4 engines under torch.profiler: host time per step, GPU busy / idle
         time and the kernels that fill it (part_profile).
- regs:  the same step through the Gluon kernel whose MMA operands are built in registers
         (kernels/quant_mma_regs.py), tiles swept at 1-64 rows, beside bf16 and the engine's path (part_regs).
- wgmma: the same step through Hopper's wgmma kernels (kernels/quant_wgmma.py; kernels/quant_wgmma_smem.py once
         its GPU test passed), tiles swept at 8-1024 rows (part_wgmma).
- tests: the int4 kernels' GPU tests (tests/kernels/test_kernels_quant_{mma_regs,wgmma,wgmma_smem}.py), pytest in a
         subprocess with a time limit: passed only if none failed or skipped.

The w8a8_layers part (each decoder linear, Fp8Linear vs bf16; the activation quantization, Triton vs torch) was
retired: it runs at `git checkout be1a1ae`. The w8a8 part (fp8 W8A8 / fp8 KV engine throughput beside bf16, KV
block counts, the Fp8Linear layer's error; e2e covers its engines) was retired: it runs at `git checkout 41306f6`.
kv and int4 write bench/results/quant_gpu_<device>.json (fields: workload, device, numbers). `--smoke` runs the
same code paths on CPU at tiny shapes (Triton under its interpreter; e2e without fp8 weights, which the engine
refuses on CPU) and writes the *_smoke.json files.

    python -m bench.quant_gpu                        # kv and int4 on a GPU
    python -m bench.quant_gpu --parts e2e --batches 1 16 --no-check        # 8 engines: ~7-8 min on an H100
    python -m bench.quant_gpu --parts e2e --batches tput --num-prompts 500  # 4 engines + the check: ~8 min
    (N=1000 as the issue asks: --batches tput --modes fp8 int4 --no-check, then --modes int4_fp8kv)
    python -m bench.quant_gpu --smoke --parts e2e kv int4
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # must precede the first `import triton` (the kernels below import it)
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from bench.harness.jobs import answer_job, run_jobs  # noqa: E402
from bench.harness.records import RESULTS, device_slug, gpu_name, write_json  # noqa: E402
from bench.harness.runs import first_divergence, output_tokens, step_until_done, timed_generate  # noqa: E402
from bench.harness.timing import wall_seconds  # noqa: E402
from bench.quant_int4 import (  # noqa: E402
    GPU_KERNEL_TESTS,
    gpu_tests,
    graph_ms,
    part_int4,
    part_mma,
    part_regs,
    part_wgmma,
    rel_err,
)
from kernels.fp8_kv import quantize_fp8  # noqa: E402
from kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref  # noqa: E402

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 32, 8, 128  # Llama-3.1-8B
PARTS = ("e2e", "kv", "int4", "mma", "regs", "wgmma", "profile", "tests")
MODULE = "bench.quant_gpu"


# ----------------------------------------------------------------------------------------- e2e (issue 32)
E2E_MODES: dict[str, dict[str, str]] = {"bf16": {}, "fp8": {"quantization": "fp8"}, "int4": {"quantization": "awq"},
                                        "int4_fp8kv": {"quantization": "awq", "kv_cache_dtype": "fp8"},
                                        "gguf": {"quantization": "gguf"}}  # dummy GGUF: Q4_1 linears, Q8_0 head
CHECK_PROMPTS = [[5, 17, 300, 42], [7] * 20, list(range(100, 140)), [1, 2, 3] * 30]


def e2e_one(job: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: build the engine, time the batch at once (the first batch after the engine is ready),
    then repeat it on new prompts of the same shape (a repeat must not hit the prefix cache). Or the check."""
    if "check_dtype" in job:
        return e2e_gguf_check(job) if job.get("quantization") == "gguf" else e2e_check(job)
    from kvflow import LLM, SamplingParams

    if "profile" in job:  # one prompt's decode under torch.profiler (bench/tp_gpu.py's summaries)
        from bench.tp_gpu import profiled_throughput

        llm = LLM(**job["engine"])
        try:
            return profiled_throughput(llm, **job["profile"])
        finally:
            llm.close()
    from kvflow.benchmarks.throughput import random_prompts

    started = time.perf_counter()
    llm = LLM(**job["engine"])
    load_s = time.perf_counter() - started
    (n, in_len, out_len), vocab = job["shape"], llm.llm_engine.config.model.arch.vocab_size
    params = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    tok_s = []
    for seed in range(1 + job["repeats"]):
        outs, seconds = timed_generate(llm, random_prompts(n, in_len, vocab, seed), params)
        tok_s.append(output_tokens(outs) / seconds)
    llm.close()
    return {"first_batch_out_tok_s": round(tok_s[0], 1), "out_tok_s": round(statistics.median(tok_s[1:]), 1),
            "load_s": round(load_s, 1)}


def e2e_check(job: dict[str, Any]) -> dict[str, Any]:
    """Greedy ids of the dummy AWQ engine vs a dense checkpoint of the same weights (its int4 linears dequantized,
    every other tensor as that engine holds it), both through the engine at job["check_dtype"]."""
    from safetensors.torch import save_file

    from engine.arg_utils import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.quant.quant_layers import QuantLinear
    from engine.sampling_params import SamplingParams

    def greedy(path: str, logprobs: int | None, **kw: Any) -> tuple[Any, list[Any]]:
        engine = LLMEngine(EngineArgs(model=path, dtype=job["check_dtype"], max_model_len=256, seed=0,
                                      kv_cache_memory_bytes=64 << 20, **job["device"], **kw).create_engine_config())
        for n, prompt in enumerate(CHECK_PROMPTS):
            engine.add_request(f"r{n}", prompt, SamplingParams(max_tokens=16, temperature=0, logprobs=logprobs,
                                                                ignore_eos=True))
        done = step_until_done(engine)[0]
        return engine, [done[f"r{n}"].outputs[0] for n in range(len(CHECK_PROMPTS))]

    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "config.json").write_text(json.dumps(job["config"]))
        int4, ours = greedy(tmp, None, load_format="dummy", quantization="awq")
        model = int4.runner.model
        quant = {name: m for name, m in model.named_modules() if isinstance(m, QuantLinear)}
        state = dense_state(model)
        layouts = sorted({m.layout for m in quant.values()})
        int4.shutdown()
        del int4, model, quant  # the dense engine needs no memory of theirs
        save_file(state, str(Path(tmp, "model.safetensors")))
        want = greedy(tmp, 5)[1]
    exact = sum(o.token_ids == w.token_ids for o, w in zip(ours, want, strict=True))
    top5 = sum(o.token_ids[k] in w.logprobs[k] for o, w in zip(ours, want, strict=True)
               if (k := first_divergence(o.token_ids, w.token_ids)) is not None)
    return {"layouts": layouts, "exact": exact, "diverged_within_top5": top5, "prompts": len(CHECK_PROMPTS),
            "verdict": "PASS" if exact + top5 == len(CHECK_PROMPTS) else "FAIL"}


def dense_state(model: Any) -> dict[str, torch.Tensor]:
    """An HF checkpoint's state dict of `model`'s weights as it holds them: quantized linears and tables
    dequantized (fused ones split into their parts), every other tensor as is, on the CPU."""
    from engine.models.weight_map import checkpoint_keys, checkpoint_modules
    from engine.quant.dummy_int4 import part_rows
    from engine.quant.group_quant import dequantize
    from engine.quant.quant_layers import QuantEmbedding, QuantLinear
    from engine.runner.cpu_linear import PackedLinear

    modules = dict(model.named_modules())
    quant = {name: m for name, m in modules.items() if isinstance(m, QuantLinear)}
    dense = dict(model.named_parameters()) | {f"{name}.weight": m.weight for name, m in modules.items()
                                               if isinstance(m, PackedLinear)}  # CPU fp32: oneDNN-packed
    state = {checkpoint_keys(type(model), name)[0]: p.detach().cpu() for name, p in dense.items()
             if name.rpartition(".")[0] not in quant}
    for path, linear in quant.items():
        parent = path.rpartition(".")[0]
        table = isinstance(modules.get(parent), QuantEmbedding)  # its linear holds a table's rows
        bases = checkpoint_modules(type(model), parent if table else path)
        rows = [linear.out_features] if table else part_rows(model, path, bases)
        parts = dequantize(linear.quant_weight()).cpu().split(rows)
        state |= {f"{base}.weight": w.contiguous() for base, w in zip(bases, parts, strict=True)}
    return state


def e2e_gguf_check(job: dict[str, Any]) -> dict[str, Any]:
    """Greedy ids of the dummy GGUF engine (Q4_1 linears, Q8_0 table and head) at job["check_dtype"] against HF
    transformers, in fp32 on the same device, on the dense checkpoint of the same weights (the GGUF tensors
    dequantized): PASS when each is equal, or first leaves HF's ids at a token in HF's top-5 of that step."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.arg_utils import EngineArgs
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "config.json").write_text(json.dumps(job["config"]))
        engine = LLMEngine(EngineArgs(model=tmp, dtype=job["check_dtype"], max_model_len=256, seed=0,
                                      kv_cache_memory_bytes=64 << 20, load_format="dummy", quantization="gguf",
                                      **job["device"]).create_engine_config())
        for n, prompt in enumerate(CHECK_PROMPTS):
            engine.add_request(f"r{n}", prompt, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True,
                                                                logprobs=1))
        done = step_until_done(engine)[0]
        outs = [done[f"r{n}"].outputs[0] for n in range(len(CHECK_PROMPTS))]
        state = dense_state(engine.runner.model)
        device = next(engine.runner.model.parameters()).device
        engine.shutdown()
        del engine
    hf = LlamaForCausalLM(LlamaConfig(**job["config"])).float()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # (a tied head is the embedding)
        raise RuntimeError(f"dense checkpoint does not fit HF's model: missing {missing}, unexpected {unexpected}")
    hf = hf.to(device).eval()
    exact = top5 = 0
    gap = 0.0  # the largest |logprob difference| of our chosen token, over the steps before any divergence
    for prompt, mine_out in zip(CHECK_PROMPTS, outs, strict=True):
        mine = mine_out.token_ids
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=16, do_sample=False,
                              output_scores=True, return_dict_in_generate=True, pad_token_id=0, eos_token_id=None,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device))
        theirs = out.sequences[0, len(prompt):].tolist()
        k = first_divergence(mine, theirs)
        exact += k is None
        top5 += k is not None and mine[k] in out.scores[k][0].topk(5).indices.tolist()
        for step in range(len(mine) if k is None else k + 1):
            theirs_lp = out.scores[step][0].float().log_softmax(-1)[mine[step]].item()
            gap = max(gap, abs(mine_out.logprobs[step][mine[step]].logprob - theirs_lp))
    return {"oracle": "HF transformers fp32", "exact": exact, "diverged_within_top5": top5,
            "max_abs_logprob_diff": round(gap, 5),
            "prompts": len(CHECK_PROMPTS), "verdict": "PASS" if exact + top5 == len(CHECK_PROMPTS) else "FAIL"}


def part_e2e(args: argparse.Namespace) -> dict[str, Any]:
    """Jobs batch by batch, bf16 first in each; the file is written after every job, and a second call adds
    its (mode, batch) records to the first's (each ratio is to the bf16 of the run that measured it)."""
    from engine.models.presets import preset_hf_config

    smoke, started, device = args.smoke, time.monotonic(), gpu_name()
    model, (in_len, out_len) = ("tiny-llama", (16, 8)) if smoke else ("llama-3.1-8b", (512, 128))
    modes = ["bf16", *(m for m in args.modes if m != "bf16" and not (smoke and m == "fp8"))]  # CPU: no fp8 weights
    path = args.e2e_out or RESULTS / f"quant_e2e_{'smoke' if smoke else device_slug(device)}.json"
    doc = json.loads(path.read_text()) if path.exists() else {"records": []}
    run: dict[str, Any] = {"command": " ".join(sys.argv[1:]), "started": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                         time.gmtime()),
                           "load_s": {}, "errors": []}
    doc["runs"] = [*doc.get("runs", []), run]
    left = lambda cap: min(cap, args.budget_s - (time.monotonic() - started))  # noqa: E731
    if args.check:
        config = preset_hf_config(model).to_dict() | ({} if smoke else {"num_hidden_layers": 2, "vocab_size": 32000})
        doc["check"] = {"workload": f"{model} shapes ({config['num_hidden_layers']} layers, vocab "
                                    f"{config['vocab_size']}), dummy AWQ vs the dense checkpoint of the same "
                                    f"weights, {len(CHECK_PROMPTS)} prompts x 16 greedy tokens; PASS: each equal, "
                                    "or first leaving at a token in the dense run's top-5", "device": device}
        quants = ["awq", *(["gguf"] if "gguf" in args.modes else [])]
        if "gguf" in quants:
            doc["gguf_check"] = {"workload": f"{model} shapes ({config['num_hidden_layers']} layers, vocab "
                                             f"{config['vocab_size']}), dummy GGUF (Q4_1, Q8_0 table and head) vs HF "
                                             f"transformers fp32 on its dequantized weights, {len(CHECK_PROMPTS)} "
                                             "prompts x 16 greedy tokens; PASS: each equal, or first leaving at a "
                                             "token in HF's top-5", "device": device}
        jobs = [{"check_dtype": dtype, "config": config, "device": {"device": "cpu"} if smoke else {},
                 "quantization": quant} for quant in quants for dtype in ("float32", "bfloat16")]
        for job, res in zip(jobs, run_jobs(MODULE, jobs, left(300)), strict=True):  # side by side: small engines
            doc["check" if job["quantization"] == "awq" else "gguf_check"][job["check_dtype"]] = res
            print("e2e check", job["quantization"], job["check_dtype"], res, flush=True)
        write_json(path, doc)
    base = {"model": model, "load_format": "dummy", "max_model_len": in_len + out_len + 16}
    base |= {"device": "cpu", "kv_cache_memory_bytes": 16 << 20} if smoke else {"dtype": "bfloat16"}
    with tempfile.TemporaryDirectory(prefix="quant-e2e-triton-") as caches:
        for batch in [b if b == "tput" else int(b) for b in args.batches]:
            n = batch if batch != "tput" else 4 if smoke else args.num_prompts
            bf16 = None
            for mode in modes:
                if left(1e9) < (120 if batch == "tput" else 45):  # too little left for the engine and its batches
                    run["errors"].append({"mode": mode, "batch": batch, "error": "not run: --budget-s spent"})
                    continue
                job = {"engine": base | E2E_MODES[mode], "shape": [n, in_len, out_len],
                       "repeats": 1 if batch == "tput" else 3}
                env = {} if args.machine_triton_cache else {"TRITON_CACHE_DIR": os.path.join(caches, mode)}
                os.makedirs(os.path.join(caches, mode), exist_ok=True)
                res = run_jobs(MODULE, [job], left(420 if batch == "tput" else 240), env)[0]
                print("e2e", mode, batch, res, flush=True)
                if "error" in res:  # an earlier call's record of this (mode, batch), if any, stays
                    run["errors"].append({"mode": mode, "batch": batch, **res})
                else:
                    bf16 = res["out_tok_s"] if mode == "bf16" else bf16
                    doc["records"] = [r for r in doc["records"] if (r["mode"], r["batch"]) != (mode, batch)]
                    doc["records"].append({
                        "workload": f"{model} dummy weights, {n} x {in_len} in / {out_len} out, greedy, ignore_eos, "
                                    "engine defaults; a fresh process per (mode, batch): first_batch_out_tok_s is its "
                                    "first generate, out_tok_s the median of later ones on new prompts; "
                                    + ("machine's Triton cache" if args.machine_triton_cache else
                                       "an empty Triton cache per mode, jobs in batch order 1, 16, tput"),
                        "device": device, "mode": mode, "batch": batch, "out_tok_s": res["out_tok_s"],
                        "first_batch_out_tok_s": res["first_batch_out_tok_s"],
                        "ratio_vs_bf16": round(res["out_tok_s"] / bf16, 3) if bf16 else None})
                    run["load_s"][f"{mode}/{batch}"] = res["load_s"]
                write_json(path, doc)
    checks = ["check", *(["gguf_check"] if "gguf" in args.modes else [])] if args.check else []
    failed = run["errors"] or any(doc.get(c, {}).get(d, {}).get("verdict") != "PASS"
                                  for c in checks for d in ("float32", "bfloat16"))
    return {"file": str(path), **({"error": "see the file's runs[-1].errors / check"} if failed else {})}


def part_profile(args: argparse.Namespace) -> dict[str, Any]:
    """Batch-1 decode of bf16 and int4 engines (one prompt, 512 in / 128 out; each in a fresh process) under
    torch.profiler, CUDA kernels only: per decode step the host seconds in the runner, and the GPU's busy and idle
    time with the kernels that fill it. Where an int4 GEMV gain goes in the engine. Traces are not kept."""
    model, (in_len, out_len) = ("tiny-llama", (16, 8)) if args.smoke else ("llama-3.1-8b", (512, 128))
    base = {"model": model, "load_format": "dummy", "max_model_len": in_len + out_len + 16}
    base |= {"device": "cpu", "kv_cache_memory_bytes": 16 << 20} if args.smoke else {"dtype": "bfloat16"}
    out: dict[str, Any] = {"workload": f"{model} dummy weights, 1 x {in_len} in / {out_len} out, temperature 1.0, "
                                       "engine defaults, each mode in a fresh process, torch.profiler (CUDA activity)"}
    with tempfile.TemporaryDirectory(prefix="quant-profile-") as traces:
        for mode in ("bf16", "int4"):
            job = {"engine": base | E2E_MODES[mode],
                   "profile": {"num_prompts": 1, "input_len": in_len, "output_len": out_len,
                               "trace": os.path.join(traces, f"{mode}.trace.json.gz")}}
            out[mode] = run_jobs(MODULE, [job], 300)[0]
            print("profile", mode, out[mode], flush=True)
    if any("error" in out[m] for m in ("bf16", "int4")):
        out["error"] = "a profiled engine failed: see its record"
    return out


# ------------------------------------------------------------------------------------------------- fp8 KV
def kv_row(ctx: int, batch: int, dims: tuple[int, int, int, int], g: torch.Generator, smoke: bool,
           with_error: bool) -> dict[str, Any]:
    """bf16 vs fp8 KV at one context and batch: the engine's call (one launch, splits combined in-kernel,
    persistent tickets) in a CUDA graph."""
    dev = "cpu" if smoke else "cuda"
    heads, kv_heads, d, page = dims
    blocks_per = ctx // page
    tables = (torch.arange(batch * blocks_per, dtype=torch.int32) + 1).view(batch, blocks_per).to(dev)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    q = torch.randn(batch, heads, d, generator=g).to(dev, torch.bfloat16)
    shape = (batch * blocks_per + 1, page, kv_heads, d)
    kc = torch.randn(shape, generator=g).to(dev, torch.bfloat16)
    vc = torch.randn(shape, generator=g).to(dev, torch.bfloat16)
    row: dict[str, Any] = {"context": ctx, "batch": batch}
    tickets = torch.zeros(batch * kv_heads, dtype=torch.int32, device=dev)
    for name, (kk, vv) in {"bf16": (kc, vc), "fp8": (quantize_fp8(kc, 1.0), quantize_fp8(vc, 1.0))}.items():
        run = functools.partial(paged_decode_attention, q, kk, vv, tables, seq_lens, d ** -0.5, max_seq_len=ctx,
                                tickets=tickets)
        seconds = wall_seconds(run, 3, False) if smoke else graph_ms(run, 50) / 1e3
        row[f"{name}_us"] = round(seconds * 1e6, 1)
        if with_error:
            row[f"{name}_rel_err"] = rel_err(run(), paged_decode_attention_ref(q, kk, vv, tables, seq_lens, d ** -0.5))
        kv_bytes = 2 * batch * ctx * kv_heads * d * kk.element_size()
        row[f"{name}_GBps"] = round(kv_bytes / row[f"{name}_us"] / 1e3, 1)
    row["fp8_speedup"] = round(row["bf16_us"] / row["fp8_us"], 3)
    print("kv", row, flush=True)
    return row


def part_kv(smoke: bool) -> dict[str, Any]:
    dims = (4, 2, 32, 16) if smoke else (HEADS, KV_HEADS, HEAD_DIM, 16)
    contexts, batches = ([64, 128], [1, 2]) if smoke else ([8192, 32768], [1, 16])
    out: dict[str, Any] = {"workload": f"paged decode attention, H={dims[0]}, Hkv={dims[1]}, D={dims[2]}, block "
                                       f"{dims[3]}, kernel defaults, one launch per call in a CUDA graph (median of "
                                       "50 replays)", "cases": []}
    g = torch.Generator(device="cpu").manual_seed(1)
    out["cases"] = [kv_row(ctx, batch, dims, g, smoke, batch == batches[0] and ctx == contexts[0])
                    for ctx in contexts for batch in batches]
    block = lambda itemsize: 2 * LAYERS * dims[3] * KV_HEADS * HEAD_DIM * itemsize  # noqa: E731
    out["blocks_in_8GiB_llama8b"] = {"bf16": (8 << 30) // block(2), "fp8": (8 << 30) // block(1)}
    return out


def run_part(part: str, args: argparse.Namespace) -> dict[str, Any]:
    if part == "e2e":
        return part_e2e(args)
    if part == "int4":
        return part_int4(args.smoke)
    if part == "mma":
        return part_mma(args.smoke)
    if part == "regs":
        return part_regs(args.smoke)
    if part == "wgmma":
        return part_wgmma(args.smoke)
    if part == "profile":
        return part_profile(args)
    if part == "tests":
        if args.smoke:
            raise ValueError("the tests part runs the int4 kernels' GPU tests: it needs a Hopper GPU")
        return gpu_tests(GPU_KERNEL_TESTS, 420)
    return part_kv(args.smoke)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["kv", "int4"], choices=list(PARTS))
    parser.add_argument("--num-prompts", type=int, default=1000, help="e2e: N of the tput batch")
    parser.add_argument("--modes", nargs="+", default=list(E2E_MODES), choices=list(E2E_MODES),
                        help="e2e: these engines (bf16 always runs too)")
    parser.add_argument("--batches", nargs="+", default=["1", "16", "tput"], choices=["1", "16", "tput"])
    parser.add_argument("--no-check", dest="check", action="store_false", help="e2e: skip the int4 greedy check")
    parser.add_argument("--budget-s", type=float, default=540.0, help="e2e: jobs past this many seconds are not run")
    parser.add_argument("--machine-triton-cache", action="store_true",
                        help="e2e: the machine's Triton cache instead of an empty one per mode")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--e2e-out", type=Path, default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:  # an e2e job, in its own process
        answer_job(args.one, e2e_one)
        return
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA GPU: run with --smoke on CPU")
    record: dict[str, Any] = {"device": gpu_name(), "torch": torch.__version__, "smoke": args.smoke}
    for part in args.parts:
        try:
            record[part] = run_part(part, args)
        except Exception as exc:  # record the failure and go on with the other parts
            traceback.print_exc()
            record[part] = {"error": f"{type(exc).__name__}: {exc}"}
    tag = "smoke" if args.smoke else device_slug(gpu_name())
    if set(args.parts) - {"e2e"}:  # e2e writes its own file
        write_json(args.out or RESULTS / f"quant_gpu_{tag}.json", record)
    if any("error" in v for v in record.values() if isinstance(v, dict)):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
