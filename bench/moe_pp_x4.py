"""Expert and pipeline parallelism on four GPUs, checked and timed in one call.

Parts (`--parts`, run in this order; each writes its JSON to --out as soon as it finishes, and the timed parts
rewrite theirs after every configuration, so a call cut short keeps what it measured):
  check  token-exact, tiny fp32 models, greedy ids (24 tokens, 3 prompts) on the GPUs: tiny-qwen3-moe and
         tiny-mixtral at EP4 (`--enable-expert-parallel -tp 4`) and TP4 equal TP1's; a 4-layer tiny Llama at PP2,
         TP2 x PP2 and PP4 equals TP1's (the baselines run eager, the parallel layouts as served: CUDA graphs
         where the layout has them). And the fused MoE Triton kernel against the unfused per-expert loop, called
         directly (the engine has no switch: a CUDA model always runs fused): bf16, 1 / 7 / 64 / 512 tokens, top-8
         of 128 experts at hidden 256, plus one Qwen3-30B-A3B-shaped layer; each rank's partial sum on the
         expert-parallel drop path (other ranks' experts skipped), and the ranks' partials summed against the
         whole layer. Max abs error against an fp32 reference; PASS within max(2 x the loop's error, 3 % of the
         output's max). -> moe_x4_check.json
  moe    Qwen3-30B-A3B shapes (dummy weights, bf16): EP4 vs TP4, batch-1 decode tok/s and N x 512/128 offline
         throughput (default N 512), and EP's ratio to TP. -> moe_x4_qwen3_30b_a3b.json
  pp     Llama-3.1-70B shapes (dummy, bf16): TP2 x PP2 vs TP4, the same two numbers (default N 200).
         -> pp_x4_llama70b.json

Every engine runs in its own subprocess(es) (bench/harness/jobs.py), each job bounded by a timeout and all of
them by --budget-s (default 585 s: a device call's 10 minutes); the check's jobs run side by side (tiny models
with a fixed KV budget share the GPUs). A layout whose tiny check hung is skipped by the timed parts. Batch-1
decode tok/s is the slope between a short and a long generation of one prompt (bench/tp_gpu.py's
`batch1_decode`); MFU counts 2 x the active parameters per token over the four GPUs' dense bf16 peak.
`--smoke` runs the same code paths on CPU (gloo, no CUDA graphs, the kernel under Triton's interpreter) at world
size 2 and tiny shapes, writing moe_x4_smoke.json (check and moe) and pp_x4_smoke.json (pp).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \\
        python -m bench.moe_pp_x4 --parts check moe pp --out $OUT

Measured on 4 x H200 (2026-11-27): check 86 s (beside tp_pd_x4's check), moe ~90 s per layout (EP4 loaded in 65 s), pp: TP4 59 s (70B loaded in 35 s); TP2 x PP2 hung before the pipe fix (engine/parallel/worker.py FrameReader).
`python -m bench.moe_pp_x4 --smoke --out /tmp/x` takes 60-90 s on a 2-core CPU.
A layout at a time: `cp bench/results/moe_x4_qwen3_30b_a3b.json $OUT/; python -m bench.moe_pp_x4 --parts moe
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
from pathlib import Path
from typing import Any

from bench.harness.jobs import MULTICAST_OFF, answer_job, run_jobs
from bench.harness.records import RESULTS, git_commit, log, run_parts, write_json
from bench.harness.runs import first_divergence
from bench.tp_gpu import GRAPH_SIZES, H200_BF16_DENSE_TFLOPS, engine_job

PARTS = ("check", "moe", "pp")
FILES = {"check": "moe_x4_check.json", "moe": "moe_x4_qwen3_30b_a3b.json", "pp": "pp_x4_llama70b.json"}
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

    @property
    def name(self) -> str:
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
    moe_layouts: tuple[Layout, ...]  # checked against TP1, and timed (EP first, then TP)
    pp_check: tuple[Layout, ...]  # checked against TP1
    pp_timed: tuple[Layout, Layout]  # (pipeline layout, its TP baseline)
    kernel_cases: tuple[KernelCase, ...]
    ep_case: KernelCase  # the drop path: `world` ranks' partial sums
    side_by_side: int  # check jobs run at once
    smoke: bool

    @staticmethod
    def of(world: int, smoke: bool, side_by_side: int | None = None) -> Plan:
        """`side_by_side`: check jobs at once (default: all of them on the GPU host, 3 on a 2-core CPU)."""
        pp_check = (Layout(1, 2), Layout(2, 2)) + ((Layout(1, world),) if world > 2 else ())
        if smoke:  # Triton's interpreter is slow: tiny shapes
            cases = tuple(KernelCase(t, 16, 4, 64, 32) for t in (1, 7))
            ep_case = KernelCase(7, 16, 4, 64, 32)
        else:
            small = tuple(KernelCase(t, 128, 8, 256, 128) for t in (1, 7, 64, 512))
            cases = (*small, KernelCase(64, 128, 8, 2048, 768))  # and one Qwen3-30B-A3B layer's shapes
            ep_case = KernelCase(512, 128, 8, 256, 128)  # 128 slots per local expert: the 64-row tiles
        return Plan(world, (Layout(world, ep=True), Layout(world)), pp_check, (Layout(world // 2, 2), Layout(world)),
                    cases, ep_case, side_by_side=side_by_side or (3 if smoke else 16), smoke=smoke)


# ---- one job per subprocess -----------------------------------------------------------------------------------
def one(job: dict[str, Any]) -> dict[str, Any]:
    """Run one configuration in this process: the kernel comparison, or an engine (bench/tp_gpu.py's job)."""
    if job["kind"] == "kernel":
        return kernel_check(job)
    return engine_job(job)


def kernel_check(job: dict[str, Any]) -> dict[str, Any]:
    """Every case of `job["cases"]` and the expert-parallel drop path of `job["ep_case"]` over `job["world"]`."""
    import torch

    device = torch.device("cuda:0" if job["cuda"] else "cpu")
    with torch.inference_mode():
        rows = [kernel_case(KernelCase(**case), device) for case in job["cases"]]
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


def kernel_case(case: KernelCase, device: Any) -> dict[str, Any]:
    block = moe_block(case, device)
    return {**asdict(case), "dtype": "bf16", **errors(*unfused_and_fused(block, kernel_inputs(case, device)))}


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
        self.smoke_files: dict[str, dict[str, Any]] = {}  # the smoke's file name -> its parts' records so far
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

    def kept_records(self, part: str, rerun: set[str]) -> list[dict[str, Any]]:
        """The part's file's records of layouts not run now (a layout per device call; records are dated by their
        file's `date` and `argv`, kept in `earlier_runs`)."""
        path = self.args.out / FILES[part]
        if self.smoke or not self.args.layouts or not path.exists():
            return []
        earlier = json.loads(path.read_text())
        return [{**r, "earlier_run": {k: earlier.get(k) for k in ("date", "argv", "commit")}}
                for r in earlier.get("records", []) if r.get("layout") not in rerun]

    def write(self, part: str, record: dict[str, Any]) -> None:
        """A part's file; the smoke's two files hold their parts by name (check and moe, pp)."""
        if not self.smoke:
            write_json(self.args.out / FILES[part], record)
            return
        name = "pp_x4_smoke.json" if part == "pp" else "moe_x4_smoke.json"
        self.smoke_files.setdefault(name, {})[part] = record
        write_json(self.args.out / name, self.smoke_files[name])

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
        self.write("check", record)
        log(f"check: {record['status']} ({statuses.count('PASS')}/{len(statuses)} PASS)")

    def check_cases(self, dense_model: str) -> list[tuple[str, Layout, dict[str, Any]]]:
        """(model label, layout, job) per engine; each model's TP1 baseline first (eager)."""
        # a fixed KV budget, not a share of the GPU: the check's engines share the GPUs side by side
        fp32 = {"dtype": "float32", "kv_cache_memory_bytes": 1 << 28, "max_model_len": 1024,
                "cudagraph_capture_sizes": [1, 2, 4]} if self.cuda else {}
        ids = {"prompts": CHECK_PROMPTS, "max_tokens": CHECK_TOKENS}
        cases = []
        for label, model, layouts in (("tiny-qwen3-moe", "tiny-qwen3-moe", self.plan.moe_layouts),
                                      ("tiny-mixtral", "tiny-mixtral", self.plan.moe_layouts),
                                      ("tiny-llama-4l", dense_model, self.plan.pp_check)):
            for layout in (Layout(1), *layouts):
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
        timing = Timing("tiny-qwen3-moe" if self.smoke else "qwen3-30b-a3b", 16 if self.smoke else
                        self.args.num_prompts_moe, 64 if self.smoke else 512, 16 if self.smoke else 128, 16,
                        80 if self.smoke else 144, self.args.job_timeout)
        self.timed("moe", timing, self.plan.moe_layouts)

    def pp(self) -> None:
        timing = Timing("tiny-llama" if self.smoke else "llama-3.1-70b", 16 if self.smoke else
                        self.args.num_prompts_pp, 64 if self.smoke else 512, 16 if self.smoke else 128, 8,
                        40 if self.smoke else 136, self.args.job_timeout)
        self.timed("pp", timing, self.plan.pp_timed)

    def timed(self, part: str, timing: Timing, layouts: tuple[Layout, ...]) -> None:
        """Each layout's batch-1 decode and throughput, one engine after the other; the file is rewritten after each
        (a call cut short keeps the first), the comparison added once both are in."""
        from engine.models.loader import resolve_model

        arch = resolve_model(timing.model, "dummy").arch
        workload = (f"{timing.model} {self.dtype} dummy: batch-1 decode ({timing.decode_long - timing.decode_short} "
                    f"tokens after a 32-token prompt), {timing.num_prompts} x {timing.input_len}/{timing.output_len} "
                    "offline throughput")
        if self.args.layouts:  # a rerun of some layouts keeps the file's records of the others
            layouts = tuple(layout for layout in layouts if layout.name in self.args.layouts)
        record: dict[str, Any] = {**self.context(part), "workload": workload, "model": timing.model,
                                  "params": arch.num_params, "active_params": active_params(arch),
                                  "records": self.kept_records(part, {layout.name for layout in layouts})}
        decode = {"short": timing.decode_short, "long": timing.decode_long, "prompt_len": 32, "repeats": 2}
        tput = {"num_prompts": timing.num_prompts, "input_len": timing.input_len, "output_len": timing.output_len}
        for layout in layouts:
            log(f"{part}: {timing.model} {layout.name} (timeout {timing.timeout_s:.0f} s)")
            t0 = time.perf_counter()
            res = {"error": "skipped: its tiny check timed out"} if layout.name in self.hung else \
                self.jobs([{"kind": "engine", "engine": self.engine(timing.model, layout), "decode": decode,
                            "tput": tput}], timing.timeout_s)[0]
            log(f"{part}: {layout.name} done in {time.perf_counter() - t0:.0f} s: "
                f"{ {k: res.get(k) for k in ('load_s', 'decode_tok_s', 'output_tok_s', 'error')} }")
            row = {"workload": workload, "device": self.device, "layout": layout.name, **layout.engine_args(), **res}
            if self.cuda and "total_tok_s" in res:
                row["mfu"] = round(2 * active_params(arch) * res["total_tok_s"] /
                                   (self.plan.world * H200_BF16_DENSE_TFLOPS * 1e12), 4)
                row["mfu_peak_assumed_tflops_per_gpu"] = H200_BF16_DENSE_TFLOPS
            record["records"].append(row)
            self.write(part, record)
        record["comparison"] = compare(record["records"])
        self.write(part, record)
        log(f"{part}: {record['comparison']}")


def compare(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The first layout's numbers over the second's (EP over TP, PP over TP)."""
    first, second = rows
    out: dict[str, Any] = {"of": f"{first['layout']} / {second['layout']}"}
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
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes, world size 2: the same code paths")
    parser.add_argument("--world", type=int, default=None, help="ranks of the EP / TP layouts (default 4; smoke 2)")
    parser.add_argument("--num-prompts-moe", type=int, default=512, help="moe throughput prompts (512 in / 128 out)")
    parser.add_argument("--num-prompts-pp", type=int, default=200, help="pp throughput prompts (512 in / 128 out)")
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
