"""The correctness half of `bench.gpu_bench` (PASS/FAIL checks) and what it shares with the workloads: the
report, engines and HF models on random weights, random prompts.

- kvflow vs transformers: greedy ids equal in fp32; in bf16 the first divergence within the other side's top-5;
- --enforce-eager on and off: the same greedy ids at group sizes 1, 3 and 8;
- the fused decode kernels: single-pass split-KV decode vs the two-kernel combine and the fp64 reference, fused
  rotary + KV write bit-identical to the two kernels.

The small_gemm check (each prologue vs the fp32 reference at Llama-8B / Qwen-0.5B shapes; under the interpreter:
tests/kernels/test_kernels_small_gemm.py) and the kernel A/B timings that came along (small_gemm_timings: fused vs
the unfused chain, the tl.dot block-config sweep; fused_kernel_timings) were retired: they run at
`git checkout be1a1ae`.
"""

from __future__ import annotations

import functools
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from bench.harness.runs import first_divergence, step_until_done
from engine.arg_utils import EngineArgs
from engine.llm_engine import LLMEngine
from engine.models.presets import preset_hf_config
from engine.sampling_params import SamplingParams

DEV = torch.device("cuda")
HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Report:
    """Collects records and PASS/FAIL checks; rewrites $OUT/gpu_bench.json after every addition."""

    def __init__(self, out_dir: str | None) -> None:
        self.meta: dict[str, Any] = {}
        self.records: list[dict[str, Any]] = []
        self.checks: list[dict[str, Any]] = []
        self.path = Path(out_dir) / "gpu_bench.json" if out_dir else None

    def check(self, name: str, ok: bool, detail: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)
        self.checks.append({"check": name, "ok": ok, "detail": detail})
        self.save()

    def record(self, rec: dict[str, Any]) -> None:
        rec = {"device": self.meta.get("device"), **rec}
        print("RECORD " + json.dumps(rec), flush=True)
        self.records.append(rec)
        self.save()

    def text(self) -> str:
        return json.dumps({"meta": self.meta, "checks": self.checks, "records": self.records}, indent=1)

    def save(self) -> None:
        if self.path is not None:
            self.path.write_text(self.text())


def release_memory() -> None:
    """After the caller dropped its references: collect (graphs, caches) and return cached blocks to CUDA."""
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def build_engine(model: str, **kwargs: Any) -> LLMEngine:
    return LLMEngine(EngineArgs(model=model, **{"load_format": "dummy", "device": "cuda", "seed": 0, **kwargs})
                     .create_engine_config())


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (count, length), generator=g).tolist()


def build_hf(preset: str, dtype: torch.dtype, seed: int = 0) -> Any:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = preset_hf_config(preset)
    with torch.device(DEV):  # random init directly on the GPU
        try:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        except TypeError:
            model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype, attn_implementation="sdpa")
    model.eval()
    # No EOS: both sides generate exactly max_new_tokens (kvflow runs with ignore_eos).
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@torch.inference_mode()
def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int, want_logits: bool = False
                ) -> tuple[list[list[int]], list[torch.Tensor] | None, float]:
    """Greedy generate of equal-length prompts as one batch; (new ids per prompt, per-step logits, seconds)."""
    input_ids = torch.tensor(prompts, device=DEV)
    torch.cuda.synchronize()
    started = time.perf_counter()
    out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=new_tokens,
                         do_sample=False, return_dict_in_generate=True, output_logits=want_logits)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - started
    logits = [step.float() for step in out.logits] if want_logits else None
    return out.sequences[:, input_ids.shape[1]:].tolist(), logits, elapsed


def load_hf_weights(engine: LLMEngine, hf_model: Any) -> None:
    """Same weights on both sides: the kvflow model takes transformers' (copied in place, graph-safe)."""
    engine.runner.model.load_hf_state_dict(hf_model.state_dict())


def run_requests(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    """Submit every prompt, step to completion; wall time, TTFT/TPOT and outputs (in submission order)."""
    ids = [engine.add_request(None, p, params, output_kind="final") for p in prompts]
    engine.take_finished_timings()
    torch.cuda.synchronize()
    started = time.perf_counter()
    outputs, steps = step_until_done(engine)
    elapsed = time.perf_counter() - started
    timings = engine.take_finished_timings()
    ttfts = [t.ttft_s for t in timings if t.ttft_s is not None]
    tpots = [t.mean_tpot_s for t in timings if t.mean_tpot_s is not None]
    return {"elapsed": elapsed, "steps": steps,
            "token_ids": [list(outputs[i].outputs[0].token_ids) for i in ids],
            "logprobs": [outputs[i].outputs[0].logprobs for i in ids],
            "ttft": statistics.median(ttfts) if ttfts else None, "tpot": statistics.median(tpots) if tpots else None,
            "out_tokens": sum(len(outputs[i].outputs[0].token_ids) for i in ids)}


# ---- correctness -----------------------------------------------------------------------------------------------
def check_vs_hf(report: Report, preset: str, dtype: str, prompts: list[list[int]], new_tokens: int) -> None:
    hf = build_hf(preset, HF_DTYPES[dtype])
    engine = build_engine(preset, dtype=dtype, kv_cache_memory_bytes=256 << 20, max_model_len=512, max_num_seqs=16)
    load_hf_weights(engine, hf)
    mine = run_requests(engine, prompts, SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True,
                                                        logprobs=5))
    exact, within, worst = 0, 0, ""
    for i, prompt in enumerate(prompts):
        theirs, logits, _ = hf_generate(hf, [prompt], new_tokens, want_logits=True)
        assert logits is not None
        ours, hf_ids = mine["token_ids"][i], theirs[0]
        j = first_divergence(ours, hf_ids)
        if j is None:
            exact += 1
            within += 1
            continue
        hf_top5 = logits[j][0].topk(5).indices.tolist()
        our_top5 = [tok for tok, lp in mine["logprobs"][i][j].items() if lp.rank <= 5]
        within += ours[j] in hf_top5 and hf_ids[j] in our_top5
        worst = f"prompt {i} diverges at {j}: kvflow {ours[j]} (HF top5 {hf_top5}), HF {hf_ids[j]}"
    n = len(prompts)
    if dtype == "float32":
        report.check(f"hf_greedy_exact_{preset}_fp32", exact == n, f"{exact}/{n} identical; {worst}")
    else:
        report.check(f"hf_top5_divergence_{preset}_{dtype}", within == n,
                     f"{exact}/{n} identical, {within}/{n} identical or first divergence in the other's top-5; "
                     f"{worst}")
    del hf, engine
    release_memory()


def check_eager_vs_graphs(report: Report, preset: str, dtype: str, across_batches: bool = True) -> None:
    """Greedy ids with --enforce-eager on and off, prompts run in groups of 1, 3 and 8. fp32: every run equals
    eager batch 8. bf16 (`across_batches=False`): eager == graphs at each group size (batches of <= 16 tokens take
    the small-batch GEMMs, larger prefills cuBLAS, so bf16 ids may legitimately differ between group sizes)."""
    prompts = [p[: 5 + 7 * i] for i, p in enumerate(random_prompts(8, 64, 500, seed=3))]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    results = {}
    for eager in (True, False):
        engine = build_engine(preset, dtype=dtype, kv_cache_memory_bytes=256 << 20, max_model_len=512,
                              max_num_seqs=16, enforce_eager=eager)
        for group in (1, 3, 8):
            results[(eager, group)] = [ids for start in range(0, len(prompts), group)
                                       for ids in run_requests(engine, prompts[start : start + group], params)["token_ids"]]
        del engine
        release_memory()
    if not across_batches:
        same_group = [g for g in (1, 3, 8) if results[(True, g)] == results[(False, g)]]
        report.check(f"eager_vs_graphs_{preset}_{dtype}", len(same_group) == 3,
                     f"eager == graphs at group sizes {same_group} of (1, 3, 8)")
        return
    ref = results[(True, 8)]
    same = [k for k, v in results.items() if v == ref]
    report.check(f"eager_vs_graphs_batch_sizes_{preset}_{dtype}", len(same) == len(results),
                 f"{len(same)}/{len(results)} (eager, group size) runs identical to eager batch 8; "
                 f"differing: {[k for k in results if k not in same]}")


def rotary_then_write_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         cos_sin: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         slots: torch.Tensor) -> None:
    """The two kernels the fused rotary_and_write_kv replaces."""
    from kernels.kv_cache_write import write_kv_cache
    from kernels.rotary import rotary_embedding

    rotary_embedding(positions, q, k, cos_sin)
    write_kv_cache(k, v, key_cache, value_cache, slots)


def _single_pass_decode(heads: int, kv_heads: int, dim: int, g: torch.Generator
                        ) -> tuple[bool, float, torch.Tensor, torch.Tensor]:
    """Single-pass decode at batch 1, 4, 32 against the two-kernel path and the fp64 reference (20 launches with one
    ticket buffer: a race would move the result): (stable, worst error, last caches)."""
    import kernels.paged_decode_attention as dec

    worst, stable = 0.0, True
    for batch in (1, 4, 32):
        lens = torch.randint(1, 2000, (batch,), generator=g, device=DEV).int()
        lens[0] = 300
        blocks_per = 2000 // 16 + 1
        kc = torch.randn(batch * blocks_per + 1, 16, kv_heads, dim, generator=g, device=DEV).bfloat16()
        vc = torch.randn_like(kc)
        tables = (1 + torch.randperm(batch * blocks_per, generator=g, device=DEV)).int().view(batch, -1)
        q = torch.randn(batch, heads, dim, generator=g, device=DEV).bfloat16()
        tickets = torch.zeros(batch * kv_heads, dtype=torch.int32, device=DEV)
        call = functools.partial(dec.paged_decode_attention, q, kc, vc, tables, lens, dim**-0.5, max_seq_len=8192)
        runs = [call(tickets=tickets, single_pass=True) for _ in range(20)]
        two = call(single_pass=False)
        ref = dec.paged_decode_attention_ref(q.double(), kc.double(), vc.double(), tables, lens, dim**-0.5)
        stable &= all(torch.equal(r, runs[0]) for r in runs) and int(tickets.abs().sum()) == 0
        worst = max(worst, float((runs[0].double() - ref).norm() / ref.norm()),
                    float((runs[0].double() - two.double()).norm() / two.double().norm()))
    return stable, worst, kc, vc


def _fused_rotary_kv(heads: int, kv_heads: int, dim: int, kc: torch.Tensor, vc: torch.Tensor,
                     g: torch.Generator) -> bool:
    """The fused rotary + KV write and the two kernels it replaces on the same inputs: bit-identical."""
    from kernels.rotary import build_cos_sin_cache
    from kernels.rotary_kv_write import rotary_and_write_kv

    cos_sin = build_cos_sin_cache(8192, dim, device=DEV)
    qkv = torch.randn(1, (heads + 2 * kv_heads) * dim, generator=g, device=DEV).bfloat16()
    pos, slots = torch.tensor([777], device=DEV), torch.tensor([5 * 16 + 3], device=DEV)
    outs = []
    for fn in (rotary_and_write_kv, rotary_then_write_kv):
        x, kc2, vc2 = qkv.clone(), kc.clone(), vc.clone()
        qv, kv, vv = x.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        fn(pos, qv.view(1, heads, dim), kv.view(1, kv_heads, dim), vv.view(1, kv_heads, dim), cos_sin, kc2, vc2,
           slots)
        outs.append((x.clone(), kc2[5].clone(), vc2[5].clone()))
    return all(torch.equal(a, b) for a, b in zip(*outs, strict=True))


def check_fused_kernels(report: Report) -> None:
    g = torch.Generator(device=DEV).manual_seed(0)
    for label, heads, kv_heads, dim in (("llama8b", 32, 8, 128), ("qwen05b", 14, 2, 64)):
        stable, worst, kc, vc = _single_pass_decode(heads, kv_heads, dim, g)
        report.check(f"single_pass_decode_{label}", stable and worst < 1e-2,
                     f"20 launches identical, tickets back to 0: {stable}; worst rel err vs fp64 ref / two-kernel "
                     f"{worst:.2e}")
        same = _fused_rotary_kv(heads, kv_heads, dim, kc, vc, g)
        report.check(f"fused_rotary_kv_write_{label}", same, f"bit-identical to rotary + write_kv_cache: {same}")
