"""Expert and pipeline parallelism on four GPUs (MoE on one or two: `--world 1|2`), checked and timed in one call.

Parts (`--parts`, in this order; each writes its JSON to --out when it finishes, the timed ones after every
configuration too, so a call cut short keeps what it measured):
  check  token-exact, tiny fp32 models, greedy ids (24 tokens, 3 prompts): tiny-qwen3-moe and tiny-mixtral at EP4
         (`--enable-expert-parallel -tp 4`) and TP4, a 4-layer tiny Llama at PP2, TP2 x PP2 and PP4, each equal
         to TP1's (baselines eager, layouts as served). The fused MoE Triton kernel against the per-expert loop,
         called directly: bf16, 1 / 7 / 64 / 512 tokens, top-8 of 128 experts at hidden 256, one Qwen3-30B-A3B
         layer, and each rank's partial sum on the expert-parallel drop path summed against the whole layer; PASS
         within max(2 x the loop's error, 3 % of the output's max) of an fp32 reference. -> moe_x4_check.json
  moe    Qwen3-30B-A3B shapes (dummy, bf16): EP4 vs TP4, batch-1 decode tok/s and N x 512/128 offline throughput
         (default N 512). -> moe_x4_qwen3_30b_a3b.json
  pp     Llama-3.1-70B shapes: TP2 x PP2 vs TP4, the same numbers (default N 200). -> pp_x4_llama70b.json
`--world 2` (the MoE issue's two-GPU runs): check at EP2 / TP2 / PP2; moe: EP2 vs TP2 for Qwen3-30B-A3B and
Mixtral-8x7B (moe_x2_qwen3_30b_a3b.json, moe_x2_mixtral_8x7b.json); pp: Llama-3.1-8B PP2 vs TP2 vs two TP1
replicas (dp2, the prompts split) at 1000 x 512/128 (pp_x2_llama8b.json). `--world 1`: check = the kernel job;
moe: Qwen3-30B-A3B beside Llama-3.1-8B on the same GPU (moe_x1_qwen3_30b_a3b.json). On GPUs the kernel job times
the fused kernel and the loop (`fused_ms`, `loop_ms`), and each timed row has its MFU (2 x active parameters per
token over its GPUs' dense bf16 peak) and batch-1 decode's share of the roofline (its GPUs' measured copy
bandwidth over the active parameters' and the KV's bytes).

Every engine runs in its own subprocess(es) (bench/harness/jobs.py), bounded by a timeout each and by --budget-s
(default 585 s) together; the check's jobs run side by side. A layout whose tiny check hung is skipped by the
timed parts. Batch-1 decode tok/s: bench/tp_gpu.py's `batch1_decode`. `--smoke`: the same code paths on CPU
(gloo, no graphs, the kernel under Triton's interpreter), world 2 (or --world), files named *_smoke.json.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \\
        python -m bench.moe_pp_x4 --parts check moe pp --out $OUT

`--parts profile` (not in the default): the first MoE layout's throughput run under torch.profiler, rank 0's
kernels summarized (moe_x<world>_profile.json, its chrome trace beside it). `--parts tiles` (not in the default):
the grouped MoE GEMMs' tile sweep for each rank's expert shape of the world's layouts, on one GPU (~1 min a
shape): tables under <out>/moe_tiles/ to copy into kernels/moe_tile_tables/, which `fused_moe` then reads there.
`--parts dispatch` (not in the default, two ranks or more): the collectives one MoE layer pays with expert
parallelism, at 1-256 tokens per rank of each MoE model's hidden size: two all-reduces (tensor-parallel attention,
what runs now) vs all-gather + reduce-scatter vs two all-to-alls (data-parallel attention) -> moe_x<world>_dispatch.json.

On 4 x H200 (2026-11-27): check 86 s, moe ~90 s per layout, pp TP4 59 s. Smoke: 60-110 s on a 2-core CPU. A
layout at a time: `cp bench/results/moe_x4_qwen3_30b_a3b.json $OUT/; python -m bench.moe_pp_x4 --parts moe
--layouts tp4 --out $OUT` reruns TP4 and keeps the file's EP4 record (the device's $OUT starts empty).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

from bench.harness.jobs import MULTICAST_OFF, answer_job, run_jobs
from bench.harness.records import RESULTS, git_commit, log, run_parts, write_json
from bench.harness.runs import first_divergence
from bench.tp_gpu import GRAPH_SIZES, H200_BF16_DENSE_TFLOPS, engine_job

PARTS = ("check", "moe", "pp", "profile", "tiles", "dispatch")
DEFAULT_PARTS = ("check", "moe", "pp")
SHORT_NAMES = {"llama-3.1-70b": "llama70b", "llama-3.1-8b": "llama8b"}  # the pp files' model names
MODULE = "bench.moe_pp_x4"
CHECK_PROMPTS = [[1, 5, 9, 33, 7, 100], list(range(3, 60)), [(13 * i + 7) % 500 + 3 for i in range(100)]]
CHECK_TOKENS = 24


# ---- what runs ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """One engine's parallel layout (tp x pp ranks; `ep`: the MoE experts dealt out over the tp ranks)."""

    tp: int
    pp: int = 1
    ep: bool = False
    dp: int = 1  # replicas of tp x pp ranks each, one GPU set apiece, the prompts split between them

    @property
    def name(self) -> str:
        if self.dp > 1:
            return f"dp{self.dp}"
        if self.ep:
            return f"ep{self.tp}"
        if self.pp == 1:
            return f"tp{self.tp}"
        return f"pp{self.pp}" if self.tp == 1 else f"tp{self.tp}_pp{self.pp}"

    def engine_args(self) -> dict[str, Any]:
        return {"tensor_parallel_size": self.tp, "pipeline_parallel_size": self.pp,
                "enable_expert_parallel": self.ep}


@dataclass(frozen=True)
class KernelCase:
    """One fused-MoE comparison: `tokens` routed to `top_k` of `experts` SwiGLU experts (hidden x inter)."""

    tokens: int
    experts: int
    top_k: int
    hidden: int
    inter: int


@dataclass(frozen=True)
class Plan:
    """The layouts and sizes of a run: the GPU host's four-way layouts, or the smoke's two-way ones on CPU."""

    world: int  # ranks of the MoE layouts and of the pipeline part's TP baseline
    moe_layouts: tuple[Layout, ...]  # checked against TP1 (beyond one GPU), and timed (EP first, then TP)
    moe_models: tuple[str, ...]  # timed, a file each
    moe_reference: str | None  # one GPU: a dense model timed beside the MoE one
    pp_check: tuple[Layout, ...]  # checked against TP1
    pp_timed: tuple[Layout, ...]  # the pipeline layout, then its baselines (none on one GPU)
    pp_model: str
    kernel_cases: tuple[KernelCase, ...]
    ep_case: KernelCase  # the drop path: `world` ranks' partial sums
    side_by_side: int  # check jobs run at once
    smoke: bool

    @staticmethod
    def of(world: int, smoke: bool, side_by_side: int | None = None) -> Plan:
        """`side_by_side`: check jobs at once (default: all of them on the GPU host, 3 on a 2-core CPU)."""
        # TP2 x PP2 needs four GPUs (the smoke's gloo ranks share the CPU)
        pp_check = {1: (), 2: (Layout(1, 2),) + ((Layout(2, 2),) if smoke else ())}.get(
            world, (Layout(1, 2), Layout(2, 2), Layout(1, world)))
        pp_timed = {1: (), 2: (Layout(1, 2), Layout(2), Layout(1, dp=2))}.get(world, (Layout(world // 2, 2),
                                                                                       Layout(world)))
        moe_layouts = (Layout(1),) if world == 1 else (Layout(world, ep=True), Layout(world))
        if smoke:
            models: tuple[str, ...] = ("tiny-qwen3-moe",)
            reference, pp_model = ("tiny-llama" if world == 1 else None), "tiny-llama"
        else:
            models = ("qwen3-30b-a3b", "mixtral-8x7b") if world == 2 else ("qwen3-30b-a3b",)
            reference, pp_model = ("llama-3.1-8b" if world == 1 else None), \
                ("llama-3.1-8b" if world == 2 else "llama-3.1-70b")
        if smoke:  # Triton's interpreter is slow: tiny shapes
            cases = tuple(KernelCase(t, 16, 4, 64, 32) for t in (1, 7))
            ep_case = KernelCase(7, 16, 4, 64, 32)
        else:
            small = tuple(KernelCase(t, 128, 8, 256, 128) for t in (1, 7, 64, 512))
            cases = (*small, KernelCase(64, 128, 8, 2048, 768))  # and one Qwen3-30B-A3B layer's shapes
            ep_case = KernelCase(512, 128, 8, 256, 128)  # 128 slots per local expert: the 64-row tiles
        return Plan(world, moe_layouts, models, reference, pp_check, pp_timed, pp_model, cases, ep_case,
                    side_by_side=side_by_side or (3 if smoke else 16), smoke=smoke)


# ---- one job per subprocess -----------------------------------------------------------------------------------
def one(job: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration in this process: the kernel comparison, a tile sweep, or an engine (bench/tp_gpu.py's
    job)."""
    if job["kind"] == "kernel":
        return kernel_check(job)
    if job["kind"] == "tiles":
        return tile_sweep(job)
    if job["kind"] == "dispatch":
        return dispatch_rank(job)
    return engine_job(job)


DISPATCH_TOKENS = (1, 4, 16, 64, 256)  # tokens per rank under data-parallel attention (decode sizes)


def _dispatch_row(tokens: int, job: dict[str, Any], device: Any, dtype: Any) -> dict[str, Any]:
    """`dispatch_rank`'s timings at one size, and the per-layer sums of each design."""
    import torch
    import torch.distributed as dist

    from bench.tp_gpu import call_us

    world, cuda = job["world"], job["cuda"]
    local = torch.randn(tokens, job["hidden"], device=device).to(dtype)
    every = torch.randn(world * tokens, job["hidden"], device=device).to(dtype)
    reduced = every.clone()  # summed in place on every call: its own buffer, so the others' inputs stay finite
    gathered, scattered, sent = torch.empty_like(every), torch.empty_like(local), torch.empty_like(every)
    calls = {"all_reduce": lambda: dist.all_reduce(reduced),
             "all_gather": lambda: dist.all_gather_into_tensor(gathered, local),
             "reduce_scatter": lambda: dist.reduce_scatter_tensor(scattered, every),
             "all_to_all": lambda: dist.all_to_all_single(sent, every)}
    row: dict[str, Any] = {"tokens_per_rank": tokens, "bytes_per_rank": local.numel() * local.element_size()}
    for name, call in calls.items():
        row[name] = call_us(call, job["iters"], cuda)
    ones = torch.full((world * tokens, job["hidden"]), job["rank"] + 1.0, device=device, dtype=dtype)
    dist.all_reduce(ones)
    row["exact"] = bool((ones == world * (world + 1) / 2).all())
    key = "graph_us" if cuda else "eager_us"
    row["per_layer_us"] = {  # the collectives one MoE layer's step pays in each design
        "tp_attention_two_all_reduces": round(2 * row["all_reduce"][key], 2),
        "dp_attention_all_gather_reduce_scatter": round(row["all_gather"][key] + row["reduce_scatter"][key], 2),
        "dp_attention_two_all_to_alls": round(2 * row["all_to_all"][key], 2)}
    return row


def dispatch_rank(job: dict[str, Any]) -> dict[str, Any]:
    """One rank of the expert-parallel collectives' timing (torch.distributed: NCCL on GPUs, gloo on CPUs), at
    `tokens` per rank of `hidden` bf16 values: the all-reduce of every rank's tokens (tensor-parallel attention:
    one after the attention, one as the MoE combine, what the engine does now), and the two data-parallel
    attention forms of dispatch + combine: all-gather + reduce-scatter, and two all-to-alls (every token sent to
    every rank: with top-8 of 128 experts over 2-4 ranks nearly every token has an expert on each). µs per call,
    eager and from a CUDA graph (bench/tp_gpu.py's `call_us`); one all-reduce of known values checked (`exact`)."""
    import datetime

    import torch
    import torch.distributed as dist

    rank, world, cuda = job["rank"], job["world"], job["cuda"]
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", job["port"], world, rank == 0, timeout=datetime.timedelta(seconds=60))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world,
                            device_id=device if cuda else None)
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    try:
        for tokens in job["tokens"]:
            rows.append(_dispatch_row(tokens, job, device, dtype))
    finally:
        dist.destroy_process_group()
    return {"rank": rank, "rows": rows}


SWEEP_TOKENS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def tile_candidates(smoke: bool) -> list[Any]:
    """24 tilings (rows x (columns, depth) x (warps, stages)); the smoke's two small ones."""
    from kernels.moe_tiles import MoeTiles

    if smoke:
        return [MoeTiles(16, 32, 32, 1, 1, 1), MoeTiles(32, 32, 32, 1, 2, 1)]
    return [MoeTiles(m, n, k, 1 if m == 16 else 8, warps, stages) for m in (16, 32, 64, 128)
            for n, k in ((64, 128), (128, 64), (128, 128)) for warps, stages in ((4, 4), (8, 3))]


def tile_sweep(job: dict[str, Any]) -> dict[str, Any]:
    """Each token count's fastest tiling of `fused_moe` on one rank's expert shape (random bf16 weights, routing
    uniform over all experts, ids of other ranks' experts dropped as under expert parallelism), against the
    heuristic's; a tiling that fails to compile or launch (shared memory) is skipped."""
    import torch

    from bench.harness.timing import cuda_event_mean_seconds
    from kernels.fused_moe import fused_moe
    from kernels.moe_gemv import gemv_suits
    from kernels.moe_tiles import MoeTiles, moe_tiles

    case = KernelCase(**job["case"])  # experts: this rank's; tokens unused
    cuda = torch.cuda.is_available() and not job["smoke"]
    device, dtype = (torch.device("cuda:0"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(case.experts, 2 * case.inter, case.hidden, generator=gen, device=device) * 0.02).to(dtype)
    w2 = (torch.randn(case.experts, case.hidden, case.inter, generator=gen, device=device) * 0.02).to(dtype)

    def ms(call: Any) -> float:
        if cuda:
            return cuda_event_mean_seconds(call, 5, warmup=1) * 1e3
        started = time.perf_counter()
        call()
        return (time.perf_counter() - started) * 1e3

    best: dict[str, Any] = {}
    for tokens in job["tokens"]:
        if gemv_suits(tokens * case.top_k, job["all_experts"]):
            continue  # the per-slot GEMVs run these (kernels/moe_gemv.py)
        x = torch.randn(tokens, case.hidden, generator=gen, device=device).to(dtype)
        ids = torch.randint(0, job["all_experts"], (tokens, case.top_k), generator=gen, device=device)
        weights = torch.full((tokens, case.top_k), 1.0 / case.top_k, device=device, dtype=dtype)
        timed = []
        for tiles in [*job["candidates"], None]:
            try:
                chosen = MoeTiles(**tiles) if tiles else moe_tiles(tokens * case.top_k, case.experts)
                timed.append((ms(partial(fused_moe, x, w13, w2, weights, ids, chosen)), chosen, tiles is None))
            except Exception as exc:  # noqa: BLE001 - a tiling this GPU cannot run (resources): not a candidate
                log(f"tiles: {tokens} tokens, {tiles}: {type(exc).__name__}: {str(exc)[:120]}")
        fastest = min(timed, key=lambda t: t[0])
        heuristic_ms = next(t[0] for t in timed if t[2])
        best[str(tokens)] = {"tiles": asdict(fastest[1]), "ms": round(fastest[0], 4),
                             "heuristic_ms": round(heuristic_ms, 4), "speedup": round(heuristic_ms / fastest[0], 3)}
    return {"entries": best, "device_name": torch.cuda.get_device_name(device) if cuda else "cpu"}


def kernel_check(job: dict[str, Any]) -> dict[str, Any]:
    """Every case of `job["cases"]` and the expert-parallel drop path of `job["ep_case"]` over `job["world"]`."""
    import torch

    device = torch.device("cuda:0" if job["cuda"] else "cpu")
    with torch.inference_mode():
        rows = [kernel_case(KernelCase(**case), device, timed=job["cuda"]) for case in job["cases"]]
        return {"rows": rows, "ep_drop": ep_drop_case(KernelCase(**job["ep_case"]), job["world"], device)}


def moe_block(case: KernelCase, device: Any, experts: range | None = None, seed: int = 0) -> Any:
    """A bf16 `SparseMoeBlock` (the engine's MoE MLP) holding `experts` of `case`'s, its weights drawn by global
    expert id (as dummy weights are), so a rank's block holds the whole model's values for its experts. Scales
    keep router logits and activations near unit size."""
    import torch

    from engine.models.arch import MoEArch
    from engine.models.moe import SparseMoeBlock

    moe = MoEArch(case.experts, case.top_k, case.inter, renormalize=True, sparse_layers=(0,))
    with torch.device(device):
        block = SparseMoeBlock(case.hidden, moe, experts).to(torch.bfloat16)
    gen = torch.Generator(device=device)
    with torch.no_grad():
        for name, param in block.named_parameters():  # seeded by name: `experts.{global id}.…`
            param.normal_(0.0, param.shape[-1] ** -0.5, generator=gen.manual_seed(seed + zlib.crc32(name.encode())))
    return block.eval()


def kernel_inputs(case: KernelCase, device: Any) -> Any:
    import torch

    gen = torch.Generator(device=device).manual_seed(case.tokens)
    return torch.randn(case.tokens, case.hidden, generator=gen, device=device).to(torch.bfloat16)


def fp32_reference(block: Any, x: Any) -> Any:
    """The block's routed experts in fp32 math (kernels/fused_moe.py's `fused_moe_ref`), on its stacked weights."""
    from engine.models.moe import route
    from kernels.fused_moe import fused_moe_ref

    weights, ids = route(block.gate(x), block.moe.top_k, block.moe.renormalize, x.dtype)
    return fused_moe_ref(x, block.w13, block.w2, weights, ids - block.expert_ids.start).float()


def unfused_and_fused(block: Any, x: Any) -> tuple[Any, Any, Any]:
    """(the per-expert loop's output, the fused kernel's, the fp32 reference): the loop runs while the experts
    are separate modules, the kernel once `stack_experts` laid them out for it (what `prepare_fused_weights`
    does after a CUDA load)."""
    loop = block(x).float()
    block.stack_experts()
    return loop, block(x).float(), fp32_reference(block, x)


def errors(loop: Any, fused: Any, ref: Any) -> dict[str, Any]:
    """Max abs errors against the fp32 reference, and PASS when the kernel's is within max(2 x the loop's, 3 % of
    the output's largest value): bf16 rounds both paths (an ulp near the largest value is 0.4-0.8 % of it), while
    a wrong expert, token or weight misses by about the output's size."""
    loop_err, fused_err = float((loop - ref).abs().max()), float((fused - ref).abs().max())
    ref_max = float(ref.abs().max())
    tol = max(2 * loop_err, 0.03 * ref_max)
    return {"max_abs_err_fused": round(fused_err, 6), "max_abs_err_loop": round(loop_err, 6),
            "max_abs_fused_vs_loop": round(float((fused - loop).abs().max()), 6), "ref_max_abs": round(ref_max, 4),
            "tol": round(tol, 6), "status": "PASS" if fused_err <= tol else "FAIL"}


def kernel_case(case: KernelCase, device: Any, timed: bool = False) -> dict[str, Any]:
    """Errors of the fused kernel and the loop; `timed` (GPUs): each one's mean ms per call as well."""
    from bench.harness.timing import cuda_event_mean_seconds

    block, x = moe_block(case, device), kernel_inputs(case, device)
    def ms() -> float:
        return round(cuda_event_mean_seconds(lambda: block(x), 20, warmup=3) * 1e3, 4)
    loop_ms = ms() if timed else None  # before unfused_and_fused stacks the experts for the kernel
    row = {**asdict(case), "dtype": "bf16", **errors(*unfused_and_fused(block, x))}
    if loop_ms is not None:
        row.update(loop_ms=loop_ms, fused_ms=ms())
        row["fused_speedup"] = round(loop_ms / row["fused_ms"], 2)
    return row


def ep_drop_case(case: KernelCase, world: int, device: Any) -> dict[str, Any]:
    """Each of `world` expert-parallel ranks' blocks (its run of experts, ids shifted, the rest dropped) fused vs
    looped, and the ranks' partial sums added up against the whole layer's fp32 reference."""
    from engine.parallel.layout import _runs

    x = kernel_inputs(case, device)
    whole = moe_block(case, device)
    whole.stack_experts()
    ref = fp32_reference(whole, x)
    ranks, loops, fuseds = [], [], []
    for start, end in _runs(case.experts, world):
        loop, fused, rank_ref = unfused_and_fused(moe_block(case, device, range(start, end)), x)
        ranks.append({"experts": [start, end], **errors(loop, fused, rank_ref)})
        loops.append(loop)
        fuseds.append(fused)
    summed = errors(sum(loops), sum(fuseds), ref)
    status = "PASS" if summed["status"] == "PASS" and all(r["status"] == "PASS" for r in ranks) else "FAIL"
    return {**asdict(case), "world": world, "ranks": ranks, "summed": summed, "status": status}


# ---- the scenario ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    """A timed part's workload: model, decode lengths, throughput size, per-job timeout."""

    model: str
    num_prompts: int
    input_len: int
    output_len: int
    decode_short: int
    decode_long: int
    timeout_s: float


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from kvflow.benchmarks.pd import device_name

        self.args = args
        self.smoke: bool = args.smoke
        self.cuda = torch.cuda.is_available() and not args.smoke
        self.plan = Plan.of(args.world or (2 if args.smoke else 4), args.smoke, args.side_by_side)
        timed = list(dict.fromkeys(layout.name for layout in (*self.plan.moe_layouts, *self.plan.pp_timed)))
        if unknown := sorted(set(args.layouts or ()) - set(timed)):
            raise SystemExit(f"--layouts {' '.join(unknown)}: not a timed layout of this run ({' '.join(timed)})")
        if self.cuda and torch.cuda.device_count() < self.plan.world:
            raise SystemExit(f"needs {self.plan.world} GPUs (or --smoke on CPU)")
        if not self.cuda and not self.smoke:
            raise SystemExit("no CUDA device: run with --smoke")
        self.device = f"{self.plan.world} x {device_name()}" if self.cuda else device_name()
        self.dtype = "bf16" if self.cuda else "fp32"
        self.commit = git_commit()
        self.started = time.monotonic()
        self.copy_gbps: list[float] | None = None  # each GPU's, measured once for the rooflines
        # layouts whose tiny check job timed out (a hang in NCCL p2p or a collective): the timed parts skip them
        # rather than spend their timeout on the same hang
        self.hung: set[str] = set()

    # -- helpers
    def engine(self, model: str, layout: Layout, **extra: Any) -> dict[str, Any]:
        base: dict[str, Any] = {"model": model, "load_format": "dummy", **layout.engine_args()}
        if self.smoke:
            base.update(device="cpu", kv_cache_memory_bytes=1 << 26, max_model_len=1024)
        else:
            base.update(dtype="bfloat16", gpu_memory_utilization=0.9, max_model_len=4096,
                        cudagraph_capture_sizes=GRAPH_SIZES)
        return {**base, **extra}

    def jobs(self, jobs: list[dict[str, Any]], timeout_s: float, env: dict[str, str] | None = None
             ) -> list[dict[str, Any]]:
        """`jobs` side by side, bounded by `timeout_s` and by what is left of --budget-s (less a margin to write the
        records); skipped when under a minute is left: the device call's limit would kill them half done."""
        if self.args.budget_s:
            left = self.args.budget_s - (time.monotonic() - self.started) - 15
            if left < 60:
                why = f"skipped: {left + 15:.0f} s of --budget-s {self.args.budget_s:.0f} left"
                log(why)
                return [{"error": why} for _ in jobs]
            timeout_s = min(timeout_s, left)
        return run_jobs(MODULE, jobs, timeout_s, {**MULTICAST_OFF, **(env or {})})

    def context(self, part: str) -> dict[str, Any]:
        return {"part": part, "device": self.device, "commit": self.commit, "smoke": self.smoke,
                "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "argv": sys.argv[1:]}

    def file(self, part: str, model: str | None = None) -> str:
        """A part's results file: moe_x<world>_check.json, moe_x<world>_<model>.json, pp_x<world>_<model>.json."""
        name = part if part in ("check", "profile", "tiles", "dispatch") else \
            SHORT_NAMES.get(model or "", (model or "").replace("-", "_"))
        stem = f"{'pp' if part == 'pp' else 'moe'}_x{self.plan.world}_{name}"
        return f"{stem}_smoke.json" if self.smoke else f"{stem}.json"

    def kept_records(self, name: str, rerun: set[str]) -> list[dict[str, Any]]:
        """File `name`'s records of layouts not run now (a layout per device call; records are dated by their
        file's `date` and `argv`, kept in `earlier_runs`)."""
        path = self.args.out / name
        if self.smoke or not self.args.layouts or not path.exists():
            return []
        earlier = json.loads(path.read_text())
        return [{**r, "earlier_run": {k: earlier.get(k) for k in ("date", "argv", "commit")}}
                for r in earlier.get("records", []) if r.get("layout") not in rerun]

    def write(self, name: str, record: dict[str, Any]) -> None:
        write_json(self.args.out / name, record)

    # -- check
    def check(self) -> None:
        """Tiny fp32 greedy ids of every layout vs TP1 (side by side), and the kernel job (its own process, under
        Triton's interpreter on CPU) at the same time."""
        with tempfile.TemporaryDirectory(prefix="moe-pp-x4-") as tmp:
            dense = write_tiny_dense(Path(tmp), layers=max(4, self.plan.world))
            cases = self.check_cases(dense)
            kernel_env = {"TRITON_INTERPRET": "1"} if self.smoke else {}
            kernel_job = {"kind": "kernel", "cuda": self.cuda, "world": self.plan.world,
                          "cases": [asdict(c) for c in self.plan.kernel_cases], "ep_case": asdict(self.plan.ep_case)}
            with ThreadPoolExecutor(max_workers=1) as pool:
                kernel_future = pool.submit(self.jobs, [kernel_job], self.args.check_timeout, kernel_env)
                engine_results = self.run_side_by_side(cases)
                kernel = kernel_future.result()[0]
        record = {**self.context("check"), "workload": f"tiny fp32 greedy ids ({len(CHECK_PROMPTS)} prompts x "
                  f"{CHECK_TOKENS} tokens) vs TP1; fused MoE kernel vs the per-expert loop",
                  "ids": [{"workload": f"{row['model']} fp32 greedy ids vs tp1", "device": self.device, **row}
                          for row in self.compare_ids(cases, engine_results)],
                  "fused_moe_kernel": kernel_record(kernel)}
        self.hung = {layout.name for (_, layout, _), res in zip(cases, engine_results, strict=True)
                     if "timed out" in str(res.get("error", ""))}
        statuses = [c["status"] for c in record["ids"]] + [record["fused_moe_kernel"]["status"]]
        record["status"] = "PASS" if all(s == "PASS" for s in statuses) else "FAIL"
        self.write(self.file("check"), record)
        log(f"check: {record['status']} ({statuses.count('PASS')}/{len(statuses)} PASS)")

    def check_cases(self, dense_model: str) -> list[tuple[str, Layout, dict[str, Any]]]:
        """(model label, layout, job) per engine; each model's TP1 baseline first (eager)."""
        # a fixed KV budget, not a share of the GPU: the check's engines share the GPUs side by side
        fp32 = {"dtype": "float32", "kv_cache_memory_bytes": 1 << 28, "max_model_len": 1024,
                "cudagraph_capture_sizes": [1, 2, 4]} if self.cuda else {}
        ids = {"prompts": CHECK_PROMPTS, "max_tokens": CHECK_TOKENS}
        cases = []
        moe_check = () if self.plan.world == 1 else self.plan.moe_layouts  # one GPU: the kernel job alone
        for label, model, layouts in (("tiny-qwen3-moe", "tiny-qwen3-moe", moe_check),
                                      ("tiny-mixtral", "tiny-mixtral", moe_check),
                                      ("tiny-llama-4l", dense_model, self.plan.pp_check)):
            for layout in (Layout(1), *layouts) if layouts else ():
                engine = self.engine(model, layout, enforce_eager=layout == Layout(1), **fp32)
                cases.append((label, layout, {"kind": "engine", "engine": engine, "ids": ids}))
        return cases

    def run_side_by_side(self, cases: list[tuple[str, Layout, dict[str, Any]]]) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = []
        step = self.plan.side_by_side
        for first in range(0, len(cases), step):
            wave = cases[first : first + step]
            log(f"check: {', '.join(f'{label} {layout.name}' for label, layout, _ in wave)}")
            t0 = time.perf_counter()
            results += self.jobs([job for _, _, job in wave], self.args.check_timeout)
            log(f"check: wave done in {time.perf_counter() - t0:.0f} s")
        return results

    @staticmethod
    def compare_ids(cases: list[tuple[str, Layout, dict[str, Any]]], results: list[dict[str, Any]]
                    ) -> list[dict[str, Any]]:
        base = {label: res.get("ids") for (label, layout, _), res in zip(cases, results, strict=True)
                if layout == Layout(1)}
        rows = []
        for (label, layout, _), res in zip(cases, results, strict=True):
            if layout == Layout(1):
                continue
            ok = base[label] is not None and res.get("ids") == base[label]
            row = {"model": label, "layout": layout.name, **layout.engine_args(),
                   "cuda_graphs": res.get("cuda_graphs"), "status": "PASS" if ok else "FAIL"}
            if not ok:  # where each prompt's ids part (a late one after equal logits is a tie, not a bug)
                divergence = [first_divergence(a, b) for a, b in zip(res["ids"], base[label], strict=True)] \
                    if res.get("ids") and base[label] else None
                row.update(first_divergence=divergence, ids=res.get("ids"), tp1_ids=base[label],
                           error=res.get("error"), stderr_tail=res.get("stderr_tail"))
            rows.append(row)
        return rows

    # -- timed parts
    def moe(self) -> None:
        reference = self.plan.moe_reference
        for model in self.plan.moe_models:
            runs = [(model, layout) for layout in self.plan.moe_layouts] + ([(reference, Layout(1))] if reference
                                                                              else [])
            self.timed("moe", self.timing(model, self.args.num_prompts_moe, 144), runs, self.file("moe", model))

    def pp(self) -> None:
        if not self.plan.pp_timed:
            log("pp: one GPU has no pipeline layout to time")
            return
        model = self.plan.pp_model
        prompts = self.args.num_prompts_pp or (1000 if self.plan.world == 2 else 200)
        self.timed("pp", self.timing(model, prompts, 136), [(model, layout) for layout in self.plan.pp_timed],
                   self.file("pp", model))

    def profile(self) -> None:
        """Where the MoE model's throughput goes: its first layout on N x 512/128 (--num-prompts-moe) with rank 0
        under torch.profiler (bench/tp_gpu.py `profiled_throughput`: host seconds per step, kernel busy / idle
        time, the top kernels and classes); the chrome trace beside the record."""
        model, layout = self.plan.moe_models[0], self.plan.moe_layouts[0]
        n, io = (16, {"input_len": 64, "output_len": 16}) if self.smoke else \
            (self.args.num_prompts_moe, {"input_len": 512, "output_len": 128})
        self.args.out.mkdir(parents=True, exist_ok=True)
        trace = str((self.args.out / self.file("profile").replace(".json", ".trace.json.gz")).resolve())
        job = {"kind": "engine", "engine": self.engine(model, layout),
               "profile": {"num_prompts": n, **io, "trace": trace}}
        res = self.jobs([job], self.args.job_timeout)[0]
        self.write(self.file("profile"), {**self.context("profile"), "workload": f"{model} {self.dtype} dummy "
                   f"{layout.name}: {n} x {io['input_len']}/{io['output_len']}, rank 0 profiled", "model": model,
                   "layout": layout.name, **res})
        log(f"profile: {res.get('kernels', {}).get('class_ms')} {res.get('error') or ''}")

    def tiles(self) -> None:
        """`tile_sweep` on one GPU for each per-rank expert shape of this world's MoE layouts: each shape's table
        (kernels/moe_tiles.py's format, to copy into kernels/moe_tile_tables/) under <out>/moe_tiles/, a summary
        beside."""
        from engine.models.loader import resolve_model
        from engine.parallel.layout import shard_for
        from kernels.moe_tiles import table_name

        shapes = {}
        for model in self.plan.moe_models:
            arch = resolve_model(model, "dummy").arch
            moe = arch.moe
            for layout in self.plan.moe_layouts:
                shard = shard_for(arch, 0, layout.tp, layout.ep)  # rank 0's experts and rows of each
                experts, inter = shard.experts[1] - shard.experts[0], shard.expert_intermediate_size
                shapes[(experts, inter)] = (model, moe.num_experts, KernelCase(0, experts, moe.top_k,
                                                                              arch.hidden_size, inter))
        rows = []
        for (experts, inter), (model, all_experts, case) in shapes.items():
            log(f"tiles: {model}, {experts} experts x {inter} rows on a rank")
            job = {"kind": "tiles", "case": asdict(case), "all_experts": all_experts, "smoke": self.smoke,
                   "tokens": [16, 64] if self.smoke else list(SWEEP_TOKENS),
                   "candidates": [asdict(t) for t in tile_candidates(self.smoke)]}
            res = self.jobs([job], self.args.job_timeout, {"TRITON_INTERPRET": "1"} if self.smoke else {})[0]
            row = {"model": model, "experts": experts, "inter": inter, **res}
            if "entries" in res:
                name = table_name(experts, inter, res["device_name"])
                write_json(self.args.out / "moe_tiles" / name, {
                    "tiles": {t: e["tiles"] for t, e in res["entries"].items()}, "model": model,
                    "device": self.device, "date": self.context("tiles")["date"], "commit": self.commit,
                    "speedup_over_heuristic": {t: e["speedup"] for t, e in res["entries"].items()}})
                row["table"] = name
            rows.append(row)
        self.write(self.file("tiles"), {**self.context("tiles"), "workload": "fused_moe per token count, each "
                   "rank's expert shape, fastest of the candidate tilings vs the heuristic", "shapes": rows})

    def dispatch(self) -> None:
        """`dispatch_rank` on every rank of this world's MoE layouts, at each model's hidden size: the collectives
        behind EP with tensor-parallel attention (now) and with data-parallel attention (not built)."""
        from engine.models.loader import resolve_model
        from engine.parallel.executor import free_port

        world = self.plan.world
        if world < 2:
            log("dispatch: needs two ranks or more")
            return
        records = []
        for model in self.plan.moe_models:
            hidden = resolve_model(model, "dummy").arch.hidden_size
            port = free_port()
            jobs = [{"kind": "dispatch", "rank": r, "world": world, "port": port, "cuda": self.cuda,
                     "hidden": hidden, "tokens": [1, 4] if self.smoke else list(DISPATCH_TOKENS),
                     "iters": 5 if self.smoke else 200} for r in range(world)]
            results = self.jobs(jobs, self.args.job_timeout)
            records.append({"model": model, "hidden": hidden, "backend": "nccl" if self.cuda else "gloo",
                            **{f"rank{r}": res for r, res in enumerate(results)}})
            log(f"dispatch: {model}: {[row.get('per_layer_us') for row in results[0].get('rows', [])]}")
        self.write(self.file("dispatch"), {**self.context("dispatch"), "workload": f"{world} ranks, bf16, tokens "
                   "per rank under data-parallel attention; per MoE layer: two all-reduces of every rank's tokens "
                   "(tensor-parallel attention + the combine) vs all-gather + reduce-scatter vs two all-to-alls",
                   "records": records})

    def timing(self, model: str, num_prompts: int, decode_long: int) -> Timing:
        if self.smoke:
            return Timing(model, 16, 64, 16, 8, 40, self.args.job_timeout)
        return Timing(model, num_prompts, 512, 128, 16, decode_long, self.args.job_timeout)

    def timed(self, part: str, timing: Timing, runs: list[tuple[str, Layout]], name: str) -> None:
        """Each (model, layout)'s batch-1 decode and throughput, one engine (or replica set) after the other; the
        file is rewritten after each (a call cut short keeps the first), the comparison added once all are in."""
        from engine.models.loader import resolve_model

        workload = (f"{timing.model} {self.dtype} dummy: batch-1 decode ({timing.decode_long - timing.decode_short} "
                    f"tokens after a 32-token prompt), {timing.num_prompts} x {timing.input_len}/{timing.output_len} "
                    "offline throughput")
        if self.args.layouts:  # a rerun of some layouts keeps the file's records of the others
            runs = [(model, layout) for model, layout in runs if layout.name in self.args.layouts]
        arch = resolve_model(timing.model, "dummy").arch
        record: dict[str, Any] = {**self.context(part), "workload": workload, "model": timing.model,
                                  "params": arch.num_params, "active_params": active_params(arch),
                                  "records": self.kept_records(name, {layout.name for _, layout in runs})}
        for model, layout in runs:
            log(f"{part}: {model} {layout.name} (timeout {timing.timeout_s:.0f} s)")
            t0 = time.perf_counter()
            res = {"error": "skipped: its tiny check timed out"} if layout.name in self.hung else \
                self.run_layout(model, layout, timing)
            log(f"{part}: {layout.name} done in {time.perf_counter() - t0:.0f} s: "
                f"{ {k: res.get(k) for k in ('load_s', 'decode_tok_s', 'output_tok_s', 'error')} }")
            row = {"workload": workload, "device": self.device, "model": model, "layout": layout.name,
                   **layout.engine_args(), **res,
                   **self.ceilings(resolve_model(model, "dummy").arch, layout, res, 32 + timing.decode_long // 2)}
            record["records"].append(row)
            self.write(name, record)
        rows = record["records"]
        if len(rows) >= 2:
            record["comparison"] = compare(rows[:2])
            record["comparisons"] = [compare([rows[0], other]) for other in rows[1:]]
        self.write(name, record)
        log(f"{part}: {record.get('comparisons')}")

    def run_layout(self, model: str, layout: Layout, timing: Timing) -> dict[str, Any]:
        """One engine's decode and throughput; replicas (dp) split the prompts and run side by side, one GPU
        apiece, replica 0 timing the batch-1 decode too."""
        decode = {"short": timing.decode_short, "long": timing.decode_long, "prompt_len": 32, "repeats": 2}
        io = {"input_len": timing.input_len, "output_len": timing.output_len}
        shares = [timing.num_prompts // layout.dp + (i < timing.num_prompts % layout.dp) for i in range(layout.dp)]
        jobs = [{"kind": "engine", "tput": {"num_prompts": share, **io},
                 "engine": self.engine(model, layout, **({"device": f"cuda:{i}"} if self.cuda else {}))
                 if layout.dp > 1 else self.engine(model, layout), **({"decode": decode} if i == 0 else {})}
                for i, share in enumerate(shares)]
        results = self.jobs(jobs, timing.timeout_s)
        if layout.dp == 1:
            return results[0]
        merged = {k: v for k, v in results[0].items() if k not in ("output_tok_s", "total_tok_s")}
        if all("output_tok_s" in r for r in results):
            merged.update({k: round(sum(r[k] for r in results), 1) for k in ("output_tok_s", "total_tok_s")})
        return {**merged, "replicas": results}

    def ceilings(self, arch: Any, layout: Layout, res: dict[str, Any], context: int) -> dict[str, Any]:
        """On GPUs: MFU (2 x active parameters per token over the layout's GPUs' dense bf16 peak) and batch-1
        decode's share of the roofline (its GPUs' copy bandwidth over the bytes a decode step reads: the active
        parameters and `context` tokens' KV)."""
        if not self.cuda:
            return {}
        gpus = layout.tp * layout.pp * layout.dp
        out: dict[str, Any] = {}
        if "total_tok_s" in res:
            out["mfu"] = round(2 * active_params(arch) * res["total_tok_s"] /
                               (gpus * H200_BF16_DENSE_TFLOPS * 1e12), 4)
            out["mfu_peak_assumed_tflops_per_gpu"] = H200_BF16_DENSE_TFLOPS
        if "decode_tok_s" in res and layout.pp == 1:  # stages run one after another: no shared roofline
            if self.copy_gbps is None:
                from bench.tp_gpu import copy_bandwidth_gbps

                self.copy_gbps = copy_bandwidth_gbps(self.plan.world)
            step_bytes = 2 * active_params(arch) + arch.kv_bytes_per_token(2) * context
            roofline = sum(self.copy_gbps[: layout.tp]) * 1e9 / step_bytes
            out.update(roofline_tok_s=round(roofline, 1), copy_gbps_per_gpu=self.copy_gbps,
                       decode_share_of_roofline=round(res["decode_tok_s"] / roofline, 3))
        return out


def compare(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first layout's numbers over the second's (EP over TP, PP over TP; MoE over the dense reference)."""
    first, second = rows
    if first.get("model") == second.get("model"):
        of = f"{first['layout']} / {second['layout']}"
    else:
        of = f"{first['model']} {first['layout']} / {second['model']} {second['layout']}"
    out: dict[str, Any] = {"of": of}
    for key in ("decode_tok_s", "output_tok_s"):
        a, b = first.get(key), second.get(key)
        out[key] = round(a / b, 3) if a and b else None
    return out


def active_params(arch: Any) -> int:
    """Parameters one token runs through: an MoE layer's unpicked experts do not count."""
    if arch.moe is None:
        return arch.num_params
    idle = arch.moe.num_experts - arch.moe.top_k
    return arch.num_params - len(arch.moe.sparse_layers) * idle * arch.moe.expert_params(arch.hidden_size)


def kernel_record(result: dict[str, Any]) -> dict[str, Any]:
    if "rows" not in result:  # the job died or timed out
        return {"status": f"FAIL {result.get('error', '')}".strip(), **result}
    ok = all(r["status"] == "PASS" for r in result["rows"]) and result["ep_drop"]["status"] == "PASS"
    return {"status": "PASS" if ok else "FAIL", **result}


def write_tiny_dense(folder: Path, layers: int) -> str:
    """tiny-llama with `layers` decoder layers (the preset has 2; PP4 needs a layer per stage), as a config.json
    that `--load-format dummy` loads."""
    from engine.models.presets import preset_hf_config

    config = preset_hf_config("tiny-llama").to_dict() | {"num_hidden_layers": layers}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(DEFAULT_PARTS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, world size 2: the same code paths")
    parser.add_argument("--world", type=int, default=None, choices=(1, 2, 4),
                        help="GPUs: the EP / TP layouts' ranks (default 4; smoke 2)")
    parser.add_argument("--num-prompts-moe", type=int, default=512, help="moe throughput prompts (512 in / 128 out)")
    parser.add_argument("--num-prompts-pp", type=int, default=None,
                        help="pp throughput prompts (512 in / 128 out; default 1000 on two GPUs, 200 on four)")
    parser.add_argument("--check-timeout", type=float, default=240.0, help="seconds per wave of check jobs")
    parser.add_argument("--side-by-side", type=int, default=None,
                        help="check jobs run at once (default: all on GPUs, 3 on CPU; 1: one after the other)")
    parser.add_argument("--job-timeout", type=float, default=240.0, help="seconds per timed engine (load included)")
    parser.add_argument("--layouts", nargs="+", default=None,
                        help="the timed parts' layouts to run (e.g. tp4; names: ep4 tp4 tp2_pp2); the --out file's "
                             "records of the others are kept")
    parser.add_argument("--budget-s", type=float, default=585.0,
                        help="seconds for the whole run (the device call's 10 minutes, less start-up): no job runs "
                             "past it, one that would get under a minute is skipped; 0: no limit")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one is not None:
        answer_job(args.one, one)
        return
    started = time.perf_counter()
    bench = Bench(args)
    log(f"device {bench.device}, world {bench.plan.world}, parts {' '.join(args.parts)}")
    # one part's failure does not stop the others; each part records its own verdicts
    run_parts([p for p in PARTS if p in args.parts], lambda part: getattr(bench, part)() or True)
    log(f"all parts: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
