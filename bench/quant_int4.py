"""The int4 part of `bench.quant_gpu`: the decode step's weight GEMMs (32 layers x qkv / o / gate_up / down,
distinct weights, one CUDA graph) at batch 1, 8, 16, 64 and 256: Q4_1-style int4 (group 32) vs bf16 (cuBLAS).
`int4` is the engine's CUDA path (the kn layout's GEMV / GEMM, kernels/quant_gemm_kn.py), `int4_canonical` the
canonical layout's (kernels/quant_gemm.py); tok/s = batch / step time (weights only: no attention, no head).
The tile sweeps that chose the shipped tiles (gemv, gemm, kngemv, kngemm), the int4_tiled_gemm case and the
nibble-pair GEMV sweep (`--int4-sweeps pairs`, never timed; `quant_gemm_kn(pairs=True)` stays) were retired; they run
at `git checkout be1a1ae`."""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.harness.timing import capture_graph, graph_seconds, wall_seconds
from engine.quant.group_quant import KINDS, QuantWeight, fp16_bits, pack_int4, quant_matmul_ref
from engine.quant.kn_layout import KNWeight, from_kn, to_kn
from engine.quant.quant_layers import quant_matmul

HIDDEN, INTER, LAYERS = 4096, 14336, 32  # Llama-3.1-8B
def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def graph_ms(fn: Callable[[], Any], reps: int = 10) -> float:
    """Median ms of one replay of a CUDA graph of fn."""
    return graph_seconds(fn, reps) * 1e3


def q4_weight(n: int, k: int, dev: str, g: torch.Generator) -> QuantWeight:
    """Random codes, scales and mins made where they are used (g lives on dev: 7 billion codes take minutes on
    the host)."""
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8, device=dev)
    scales = fp16_bits(torch.rand(n, k // 32, generator=g, device=dev) * 0.002)
    return QuantWeight(4, "min", 32, n, k, pack_int4(q), scales,
                       mins=fp16_bits(-torch.rand(n, k // 32, generator=g, device=dev) * 0.01))


def kn_out(w: KNWeight, x: torch.Tensor, **overrides: Any) -> torch.Tensor:
    from kernels.quant_gemm_kn import quant_gemm_kn

    return quant_gemm_kn(x, w.qweight, w.scales, w.offsets, KINDS.index(w.kind), w.group_size, w.out_features,
                         **overrides)


def triton_matmul(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The Triton kernel itself (what `quant_matmul` picks on CUDA), for the CPU smoke run under the interpreter."""
    from kernels.quant_gemm import quant_gemm

    return quant_gemm(x, w.qweight, w.scales, w.mins if w.mins is not None else w.zeros, w.bits,
                      KINDS.index(w.kind), w.group_size, w.out_features)


def step_int4(weights: list[list[QuantWeight]], xs: dict[int, torch.Tensor], smoke: bool) -> None:
    """quant_matmul's own choice per batch (the Triton kernel itself under --smoke)."""
    for ws in weights:
        for w in ws:
            (triton_matmul if smoke else quant_matmul)(xs[w.in_features], w)


def arrivals_for(weights: list[list[KNWeight]]) -> list[list[torch.Tensor]]:
    """Each weight's split-arrival counters, as a QuantLinear holds them."""
    from kernels.quant_gemm_kn import new_arrivals

    return [[new_arrivals(w.out_features, w.qweight.device) for w in ws] for ws in weights]


def step_kn(weights: list[list[KNWeight]], xs: dict[int, torch.Tensor], arrivals: list[list[torch.Tensor]] | None,
            **overrides: Any) -> None:
    """The engine's CUDA path for 4-bit weights: the kn layout's GEMV (1 row) / GEMM (more rows); `arrivals`: the
    one-row GEMV sums its K split in the same launch (as QuantLinear runs it), None: a second launch sums;
    `overrides`: quant_gemm_kn's sweep arguments."""
    for i, ws in enumerate(weights):
        for j, w in enumerate(ws):
            kn_out(w, xs[w.in_features], arrivals=None if arrivals is None else arrivals[i][j], **overrides)


def step_bf16(weights: list[list[torch.Tensor]], xs: dict[int, torch.Tensor]) -> None:
    for ws in weights:
        for w in ws:
            F.linear(xs[w.shape[1]], w)


def step_bf16_engine(weights: list[list[torch.Tensor]], xs: dict[int, torch.Tensor]) -> None:
    """The engine's own bf16 path for one row (kernels/small_gemm.py's GEMV, as engine/models/llama.py calls it,
    without the norm / SwiGLU prologues it fuses there): faster than cuBLAS at batch 1, so the fairer baseline."""
    from kernels.small_gemm import small_gemm

    for ws in weights:
        for w in ws:
            small_gemm(xs[w.shape[1]], w, impl="gemv")


class Int4Run:
    """The step's weights in every form, the generator that made them (inputs come from it too)."""

    def __init__(self, smoke: bool) -> None:
        self.smoke = smoke
        self.dev = "cpu" if smoke else "cuda"
        hidden, inter, layers = (64, 128, 2) if smoke else (HIDDEN, INTER, LAYERS)
        self.hidden = hidden
        q_out = hidden + 2 * (hidden // 4)  # Llama-8B: 4096 + 2 x 1024
        self.shapes = [(q_out, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
        self.g = torch.Generator(device=self.dev).manual_seed(2)
        self.int4 = [[q4_weight(n, k, self.dev, self.g) for n, k in self.shapes] for _ in range(layers)]
        self.bf16 = [[torch.randn(n, k, generator=self.g, device=self.dev, dtype=torch.bfloat16) * 0.02
                      for n, k in self.shapes] for _ in range(layers)]
        self.kn = [[to_kn(w) for w in ws] for ws in self.int4]
        self.kn_arrivals = arrivals_for(self.kn)

    def inputs(self, batch: int) -> dict[int, torch.Tensor]:
        return {n: torch.randn(batch, n, generator=self.g, device=self.dev).to(torch.bfloat16)
                for n in {k for _, k in self.shapes}}

    def header(self) -> dict[str, Any]:
        """The layouts checked against the reference, before anything is timed."""
        x = torch.randn(8, self.hidden, generator=self.g, device=self.dev).to(torch.bfloat16)
        check = (triton_matmul if self.smoke else quant_matmul)(x, self.int4[0][2])
        ref = quant_matmul_ref(x.float(), self.int4[0][2])
        kn_check = {rows: rel_err(kn_out(self.kn[0][2], x[:rows].contiguous()).float(), ref[:rows]) for rows in (1, 8)}
        return {
            "workload": f"decode-step weight GEMMs, {len(self.int4)} layers x {self.shapes} (distinct weights), "
                        "int4 Q4_1-style group 32 vs bf16; int4 = the engine's CUDA path (kn layout, "
                        "kernels/quant_gemm_kn.py), int4_canonical = kernels/quant_gemm.py over the canonical layout; "
                        "bf16 = cuBLAS (F.linear), bf16_engine (batch 1) = the engine's own bf16 GEMV "
                        "(kernels/small_gemm.py)",
            "check_rel_err_vs_ref": rel_err(check.float(), ref), "kn_check_rel_err_vs_ref": kn_check,
            "kn_round_trip_exact": all(torch.equal(from_kn(k).qweight, w.qweight)
                                       for k, w in zip(self.kn[0], self.int4[0], strict=True)),
            "weight_bytes": {"int4": sum(w.nbytes for ws in self.int4 for w in ws),
                             "bf16": sum(w.numel() * 2 for ws in self.bf16 for w in ws)},
            "cases": []}

    def case(self, batch: int) -> dict[str, Any]:
        xs = self.inputs(batch)
        steps = [("bf16", functools.partial(step_bf16, self.bf16, xs)),
                 ("int4", functools.partial(step_kn, self.kn, xs, self.kn_arrivals)),
                 ("int4_canonical", functools.partial(step_int4, self.int4, xs, self.smoke))]
        if batch == 1 and self.dev == "cuda":  # (at 2+ rows the engine's bf16 linears are cuBLAS: the bf16 row)
            steps.append(("bf16_engine", functools.partial(step_bf16_engine, self.bf16, xs)))
        row: dict[str, Any] = {"batch": batch}
        for name, fn in steps:
            run = fn if self.smoke else capture_graph(fn).replay  # one graph per step: launch overhead out
            seconds = wall_seconds(run, 2 if self.smoke else 20, not self.smoke)
            row[f"{name}_step_ms"] = round(seconds * 1e3, 3)
            row[f"{name}_tok_s"] = round(batch / seconds, 1)
        row["int4_vs_bf16"] = round(row["int4_tok_s"] / row["bf16_tok_s"], 3)
        row["int4_canonical_vs_bf16"] = round(row["int4_canonical_tok_s"] / row["bf16_tok_s"], 3)
        if "bf16_engine_tok_s" in row:
            row["int4_vs_bf16_engine"] = round(row["int4_tok_s"] / row["bf16_engine_tok_s"], 3)
        print("int4", row, flush=True)
        return row


def part_int4(smoke: bool) -> dict[str, Any]:
    run = Int4Run(smoke)
    out = run.header()
    out["cases"] = [run.case(batch) for batch in (1, 8, 16, 64, 256)]
    return out


# ----------------------------------------------------------------------------------------- mma (issue 32)
# (BLOCK_M, BLOCK_N, warps, programs per SM) tried per batch; the first of each is kernels/quant_mma_kn.py's table
# (the H100 sweeps in quant_mma_h100.json had other firsts: the table's entries before each)
MMA_SWEEP: dict[int, list[tuple[int, int, int, int]]] = {
    1: [(16, 128, 4, 4), (16, 128, 4, 8), (16, 128, 8, 8), (16, 64, 2, 16), (16, 128, 2, 8), (16, 64, 1, 16),
        (16, 32, 1, 16), (16, 64, 2, 8)],
    16: [(16, 128, 4, 4), (16, 128, 2, 4), (16, 128, 4, 2), (16, 64, 2, 8), (16, 64, 1, 8), (16, 64, 2, 4)],
    32: [(16, 128, 4, 4), (32, 128, 4, 4), (32, 128, 4, 8), (32, 256, 8, 4)],
    64: [(64, 128, 4, 4), (64, 128, 8, 4), (64, 64, 4, 4), (32, 128, 4, 4), (32, 256, 8, 4)],
    128: [(128, 128, 8, 2), (64, 128, 8, 2), (64, 64, 4, 4), (32, 128, 4, 4)],
    256: [(128, 128, 8, 2), (64, 128, 8, 2), (64, 64, 4, 2), (32, 128, 4, 2)]}


def awq_weight(n: int, k: int, dev: str, g: torch.Generator) -> QuantWeight:
    """AWQ-shaped int4: zero points, groups of 128 (the dummy AWQ preset's form)."""
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8, device=dev)
    scales = fp16_bits(torch.rand(n, k // 128, generator=g, device=dev) * 0.002 + 0.0005)
    zeros = torch.randint(0, 16, (n, k // 128), generator=g, dtype=torch.uint8, device=dev)
    return QuantWeight(4, "zero", 128, n, k, pack_int4(q), scales, zeros=zeros)


def mma_out(w: KNWeight, x: torch.Tensor, **overrides: Any) -> torch.Tensor:
    from kernels.quant_mma_kn import quant_mma_kn

    return quant_mma_kn(x, w.qweight, w.scales, w.offsets, KINDS.index(w.kind), w.group_size, w.out_features,
                        **overrides)


def step_each(one: Callable[..., torch.Tensor], weights: list[list[KNWeight]], xs: dict[int, torch.Tensor],
              arrivals: list[list[torch.Tensor]], **overrides: Any) -> None:
    """`one` (kn_out / mma_out) over every weight of the step, each with its own arrival counters."""
    for i, ws in enumerate(weights):
        for j, w in enumerate(ws):
            one(w, xs[w.in_features], arrivals=arrivals[i][j], **overrides)


def awq_step(dev: str, smoke: bool) -> tuple[torch.Generator, list[tuple[int, int]], list[list[QuantWeight]],
                                               list[list[KNWeight]], list[list[torch.Tensor]],
                                               list[list[torch.Tensor]], str]:
    """The decode step's weights for the int4 kernels' sweeps: (generator, shapes, layer 0's canonical AWQ-shaped
    weights for the checks, every layer's kn weights, bf16 weights, arrival counters, the workload line)."""
    hidden, inter, layers = (128, 256, 2) if smoke else (HIDDEN, INTER, LAYERS)
    shapes = [(hidden + 2 * (hidden // 4), hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    g = torch.Generator(device=dev).manual_seed(3)
    int4 = [[awq_weight(n, k, dev, g) for n, k in shapes] for _ in range(layers)]
    kn = [[to_kn(w) for w in ws] for ws in int4]
    del int4[1:]  # (the canonical copies of layer 0 only, for the check)
    bf16 = [[torch.randn(n, k, generator=g, device=dev, dtype=torch.bfloat16) * 0.02 for n, k in shapes]
            for _ in range(layers)]
    workload = (f"decode-step weight GEMMs, {layers} layers x {shapes} (distinct weights), AWQ-shaped int4 (zero "
                "points, group 128) vs bf16, one CUDA graph per step")
    return g, shapes, int4, kn, bf16, arrivals_for(kn), workload


def part_mma(smoke: bool) -> dict[str, Any]:
    """The tensor-core int4 kernel (kernels/quant_mma_kn.py) over the decode step's AWQ-shaped weights, beside
    bf16 (cuBLAS), the engine's bf16 GEMV (batch 1) and today's kn path (GEMV / GEMM / dense), tiles swept per
    batch; its error against the reference first, paired (PTX) and not, and each timed variant's (`rel_err`)."""

    dev = "cpu" if smoke else "cuda"
    hidden, inter = (128, 256) if smoke else (HIDDEN, INTER)
    g, _, int4, kn, bf16, arrivals, workload = awq_step(dev, smoke)
    out: dict[str, Any] = {"workload": workload, "check": [], "cases": []}
    w0 = kn[0][2]
    for rows in (1, 16, 64):
        x = torch.randn(rows, hidden, generator=g, device=dev).to(torch.bfloat16)
        ref = quant_matmul_ref(x.float(), int4[0][2])
        for paired in ([False] if smoke else [False, True]):
            y = mma_out(w0, x, paired=paired)
            out["check"].append({"rows": rows, "paired": paired, "rel_err": rel_err(y.float(), ref),
                                 "bf16_rounding": rel_err(ref.to(torch.bfloat16).float(), ref)})
    print("mma check", out["check"], flush=True)
    for batch, sweep in MMA_SWEEP.items():
        xs = {n: torch.randn(batch, n, generator=g, device=dev).to(torch.bfloat16) for n in (hidden, inter)}
        variants: list[tuple[str, Callable[..., torch.Tensor], dict[str, Any]]] = [("int4_kn", kn_out, {"mma": False})]
        if batch == 1 and not smoke:  # (under 4 warps the dots are Ampere-style mma.sync, not wgmma)
            variants += [(f"int4_kn_gemv{list(t)}_pairs{p}", kn_out, {"gemv_tiles": t, "pairs": p})
                         for t, p in [((32, 4, 16, 1), False), ((32, 4, 16, 1), True), ((32, 4, 8, 1), False),
                                      ((32, 8, 16, 1), False), ((64, 4, 16, 2), False)]]
        variants += [(f"mma{list(t)}", mma_out, {"tiles": t}) for t in sweep]
        variants.append((f"mma{list(sweep[0])}_unpaired", mma_out, {"tiles": sweep[0], "paired": False}))
        steps = [("bf16", functools.partial(step_bf16, bf16, xs))]
        if batch == 1 and not smoke:
            steps.append(("bf16_engine", functools.partial(step_bf16_engine, bf16, xs)))
        steps += [(name, functools.partial(step_each, one, kn, xs, arrivals, **ov)) for name, one, ov in variants]
        # each int4 variant's output for layer 0's gate|up at this batch against the reference: the timed tiles'
        # correctness, beside bf16's own output rounding
        ref = quant_matmul_ref(xs[hidden].float(), int4[0][2])
        errors = {"bf16_rounding": rel_err(ref.to(torch.bfloat16).float(), ref)}
        for name, one, ov in variants:
            errors[name] = rel_err(one(w0, xs[hidden], arrivals=arrivals[0][2], **ov).float(), ref)
        row: dict[str, Any] = {"batch": batch}
        for name, fn in steps:
            try:
                seconds = wall_seconds(fn if smoke else capture_graph(fn).replay, 1 if smoke else 20, not smoke)
            except Exception as exc:  # a tile that fails to compile or launch: recorded, the sweep goes on
                row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                continue
            row[f"{name}_ms"] = round(seconds * 1e3, 3)
        best = min((k for k in row if k.startswith("mma") and k.endswith("_ms")), key=row.get)
        row["best_mma"] = best.removesuffix("_ms")
        row["best_mma_vs_bf16"] = round(row["bf16_ms"] / row[best], 3)
        row["int4_kn_vs_bf16"] = round(row["bf16_ms"] / row["int4_kn_ms"], 3)
        row["rel_err"] = errors
        print("mma", row, flush=True)
        out["cases"].append(row)
        if smoke:
            break
    return out


def time_steps(row: dict[str, Any], steps: list[tuple[str, Callable[[], None]]]) -> None:
    """row[name_ms]: each step captured in a CUDA graph and replayed (20 runs); a step that fails to compile or
    launch is recorded as row[name_error] and the sweep goes on."""
    for name, fn in steps:
        try:
            row[f"{name}_ms"] = round(wall_seconds(capture_graph(fn).replay, 20, True) * 1e3, 3)
        except Exception as exc:
            row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"


def mark_best(row: dict[str, Any], prefix: str) -> None:
    """best_<prefix>: the fastest timed variant named <prefix>..., and its speed against bf16 and int4_kn."""
    timed = [k for k in row if k.startswith(prefix) and k.endswith("_ms")]
    if timed:
        best = min(timed, key=row.get)
        row[f"best_{prefix}"] = best.removesuffix("_ms")
        row[f"best_{prefix}_vs_bf16"] = round(row["bf16_ms"] / row[best], 3)
        row[f"best_{prefix}_vs_int4_kn"] = round(row["int4_kn_ms"] / row[best], 3)


# (warps, column tiles per warp, programs per SM, iterations loaded ahead into registers, cp.async stages (0 =
# none), q - z as the MMA operand) swept per batch for kernels/quant_mma_regs.py
REGS_SWEEP: dict[int, list[tuple[int, int, int, int, int, bool]]] = {
    1: [(4, 2, 8, 1, 0, False), (4, 2, 8, 1, 0, True), (4, 2, 8, 2, 0, False), (8, 2, 4, 1, 0, False),
        (1, 2, 24, 1, 3, False), (4, 2, 8, 1, 3, False), (4, 4, 8, 1, 0, True), (8, 1, 8, 1, 0, False)],
    4: [(4, 2, 8, 1, 0, True), (2, 2, 16, 1, 0, True)],
    16: [(2, 2, 8, 1, 0, False), (2, 2, 8, 1, 0, True), (2, 2, 8, 2, 0, True), (4, 2, 4, 1, 0, True),
         (2, 2, 8, 1, 3, True)],
    32: [(1, 1, 16, 1, 0, True), (2, 1, 8, 1, 0, True), (1, 2, 8, 1, 0, True)],
    64: [(2, 1, 4, 1, 0, True), (2, 1, 8, 1, 0, True)]}


def regs_out(w: KNWeight, x: torch.Tensor, **overrides: Any) -> torch.Tensor:
    from kernels.quant_mma_regs import quant_mma_regs

    return quant_mma_regs(x, w.qweight, w.scales, w.offsets, KINDS.index(w.kind), w.group_size, w.out_features,
                          **overrides)


def part_regs(smoke: bool) -> dict[str, Any]:
    """The Gluon kernel with its MMA operands built in registers (kernels/quant_mma_regs.py) over the decode
    step's AWQ-shaped weights, tiles swept per batch, beside bf16 (cuBLAS), the engine's bf16 GEMV (batch 1),
    today's engine path (`int4_kn`: the kn GEMV at one row, the plain-Triton tensor-core kernel at 2-16 rows, the
    kn GEMM above) and the GEMV tile (64, 4, 16, 2) that ran faster in quant_mma_h100.json run 2; each timed
    variant's output (layer 0's gate|up) against the reference first. CUDA only (Gluon has no interpreter)."""
    if smoke:
        raise ValueError("the regs part needs a GPU: Gluon kernels have no CPU interpreter")
    dev = "cuda"
    g, shapes, int4, kn, bf16, arrivals, workload = awq_step(dev, False)
    out: dict[str, Any] = {"workload": workload, "cases": []}
    for batch, sweep in REGS_SWEEP.items():
        xs = {n: torch.randn(batch, n, generator=g, device=dev).to(torch.bfloat16) for n in (HIDDEN, INTER)}
        variants: list[tuple[str, Callable[..., torch.Tensor], dict[str, Any]]] = [("int4_kn", kn_out, {})]
        if batch == 1:
            variants.append(("int4_kn_gemv[64, 4, 16, 2]", kn_out, {"gemv_tiles": (64, 4, 16, 2)}))
        if batch == 16:
            variants.append(("mma[16, 128, 2, 4]", mma_out, {"tiles": (16, 128, 2, 4)}))
        variants += [(f"regs{list(t)}", regs_out, {"tiles": t[:3], "ahead": t[3], "stages": t[4], "subz": t[5]})
                     for t in sweep]
        ref = quant_matmul_ref(xs[HIDDEN].float(), int4[0][2])
        errors = {"bf16_rounding": rel_err(ref.to(torch.bfloat16).float(), ref)}
        for name, one, ov in variants:
            errors[name] = rel_err(one(kn[0][2], xs[HIDDEN], arrivals=arrivals[0][2], **ov).float(), ref)
        steps = [("bf16", functools.partial(step_bf16, bf16, xs))]
        if batch == 1:
            steps.append(("bf16_engine", functools.partial(step_bf16_engine, bf16, xs)))
        steps += [(name, functools.partial(step_each, one, kn, xs, arrivals, **ov)) for name, one, ov in variants]
        row: dict[str, Any] = {"batch": batch, "rel_err": errors}
        time_steps(row, steps)
        mark_best(row, "regs")
        if batch == 1:  # each weight shape alone (its 32 layers): where the step's time goes
            best_ov = next(ov for name, _, ov in variants if name == row.get("best_regs"))
            for i, (n, k) in enumerate(shapes):
                for name, one, ov in [("int4_kn", kn_out, {}), ("best_regs", regs_out, best_ov)]:
                    only = [[ws[i]] for ws in kn]
                    fn = functools.partial(step_each, one, only, xs, [[a[i]] for a in arrivals], **ov)
                    ms = wall_seconds(capture_graph(fn).replay, 20, True) * 1e3
                    gbytes = LAYERS * (n * k // 2 + 3 * n * k // 128) / 1e9
                    row.setdefault("per_shape", []).append({"shape": [n, k], "path": name, "ms": round(ms, 3),
                                                           "tb_s": round(gbytes / ms, 3)})
        print("regs", row, flush=True)
        out["cases"].append(row)
    return out


# (warpgroups per program, column tiles of 64 per warpgroup, token rows per program, programs per SM, x loaded an
# iteration ahead, asynchronous MMA from shared memory) swept per batch for kernels/quant_wgmma.py
_SYNC, _ASYNC = (False, False), (False, True)  # (x ahead, overlap)
WGMMA_SWEEP: dict[int, list[tuple[int, int, int, int, bool, bool]]] = {
    8: [(1, 1, 16, 4, *_SYNC)],
    12: [],  # (the default tile, beside the regs kernel)
    16: [(2, 1, 16, 4, *_SYNC), (4, 1, 16, 2, *_SYNC)],
    32: [(2, 1, 32, 4, *_SYNC), (4, 1, 32, 2, *_SYNC), (1, 1, 32, 4, *_SYNC)],
    64: [(1, 1, 64, 4, *_SYNC), (2, 1, 64, 2, *_SYNC), (2, 1, 64, 2, True, False), (2, 1, 64, 2, *_ASYNC),
         (2, 1, 64, 3, *_SYNC), (4, 1, 64, 1, *_SYNC), (2, 2, 64, 1, *_SYNC), (1, 2, 64, 2, *_SYNC)],
    96: [(2, 1, 64, 2, *_SYNC)],
    128: [(2, 1, 128, 1, *_SYNC), (2, 1, 128, 1, *_ASYNC), (2, 1, 64, 2, *_SYNC), (2, 1, 64, 2, True, False),
          (4, 1, 64, 1, *_SYNC), (1, 1, 128, 2, *_SYNC), (2, 2, 64, 1, *_SYNC), (1, 2, 64, 2, *_SYNC)],
    256: [(2, 1, 128, 1, *_SYNC), (2, 1, 128, 1, *_ASYNC), (2, 1, 64, 2, *_SYNC), (2, 1, 64, 2, *_ASYNC),
          (4, 1, 64, 1, *_SYNC), (2, 2, 64, 1, *_SYNC), (1, 2, 64, 2, *_SYNC)],
    384: [], 512: [],  # (no tile of its own: the default tile, the shared-memory kernel and the dense path)
    1024: [(2, 1, 128, 1, *_SYNC), (2, 1, 128, 1, *_ASYNC), (2, 1, 64, 2, *_SYNC)]}


# (columns per program, warps, x stages, programs per SM, token rows per program) swept per batch for
# kernels/quant_wgmma_smem.py; BM 256 (two 64-row MMA blocks a warpgroup) from 256 rows
_SMEM_LARGE = [(128, 8, 3, 2, 128), (256, 8, 4, 1, 128), (128, 8, 3, 1, 256), (128, 8, 4, 1, 256)]
SMEM_SWEEP: dict[int, list[tuple[int, int, int, int, int]]] = {
    64: [(128, 4, 4, 2, 64), (256, 4, 4, 1, 64), (128, 8, 3, 2, 128)],
    96: [(128, 8, 3, 2, 128), (256, 8, 4, 1, 128)],
    128: [(128, 8, 4, 1, 128), (128, 8, 3, 2, 128), (256, 8, 4, 1, 128), (128, 4, 4, 2, 64)],
    256: [*_SMEM_LARGE, (128, 8, 4, 1, 128), (256, 8, 3, 1, 128)],
    384: _SMEM_LARGE, 512: _SMEM_LARGE, 1024: _SMEM_LARGE}


def smem_out(w: KNWeight, x: torch.Tensor, arrivals: torch.Tensor | None = None,
             **overrides: Any) -> torch.Tensor:
    """`arrivals` is taken for step_each's signature and not used (a split is summed in a second launch)."""
    from kernels.quant_wgmma_smem import quant_wgmma_smem

    return quant_wgmma_smem(x, w.qweight, w.scales, w.offsets, KINDS.index(w.kind), w.group_size,
                            w.out_features, **overrides)


def wgmma_out(w: KNWeight, x: torch.Tensor, arrivals: torch.Tensor | None = None,
              **overrides: Any) -> torch.Tensor:
    """`arrivals` is taken for step_each's signature and not used: the wgmma kernel sums a split in a second
    launch."""
    from kernels.quant_wgmma import quant_wgmma

    return quant_wgmma(x, w.qweight, w.scales, w.offsets, KINDS.index(w.kind), w.group_size, w.out_features,
                       **overrides)


GPU_KERNEL_TESTS = ("tests/kernels/test_kernels_quant_mma_regs.py", "tests/kernels/test_kernels_quant_wgmma.py",
                    "tests/kernels/test_kernels_quant_wgmma_smem.py")


def gpu_tests(files: tuple[str, ...], timeout_s: float) -> dict[str, Any]:
    """pytest over `files` in a subprocess (a hung kernel costs the timeout, not the run): its summary line, and
    `passed` when every test passed and none was skipped (their GPU tests skip off a Hopper GPU)."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"files": list(files), "passed": False, "summary": f"timed out after {timeout_s:.0f} s"}
    lines = proc.stdout.strip().splitlines() or [""]
    return {"files": list(files), "passed": proc.returncode == 0 and "skipped" not in lines[-1],
            "summary": lines[-1], **({} if proc.returncode == 0 else {"output_tail": proc.stdout[-3000:]})}


def part_wgmma(smoke: bool) -> dict[str, Any]:
    """Hopper's wgmma int4 kernels over the decode step's AWQ-shaped weights at 8-1024 rows, tiles swept per batch:
    kernels/quant_wgmma.py (`wgmma[...]`) and, after its GPU test passed (a wrong or hung kernel is not timed),
    kernels/quant_wgmma_smem.py (`smem[...]`), beside bf16 (cuBLAS), the engine's path (`int4_kn`), the kn GEMM
    (below 128 rows) or the dense dequantization (from 128); each variant's output (layer 0's gate|up) against the
    reference first. CUDA sm_90 only."""
    if smoke:
        raise ValueError("the wgmma part needs a Hopper GPU: Gluon kernels have no CPU interpreter")
    from kernels.quant_wgmma import wgmma_entry

    dev = "cuda"
    smem_test = gpu_tests(GPU_KERNEL_TESTS[2:], 300)
    print("wgmma smem test", smem_test, flush=True)
    g, _, int4, kn, bf16, arrivals, workload = awq_step(dev, False)
    out: dict[str, Any] = {"workload": workload, "smem_test": smem_test, "cases": []}
    for batch, sweep in WGMMA_SWEEP.items():
        xs = {n: torch.randn(batch, n, generator=g, device=dev).to(torch.bfloat16) for n in (HIDDEN, INTER)}
        variants: list[tuple[str, Callable[..., torch.Tensor], dict[str, Any]]] = [("int4_kn", kn_out, {})]
        if batch <= 64:
            variants.append(("regs", regs_out, {}))  # (the engine's path through 32 rows)
        variants += [("int4_gemm" if batch < 128 else "int4_dense", kn_out,
                      {"wgmma": False, "regs": False, "dense": batch >= 128})]
        variants += [(f"wgmma{list(t)}", wgmma_out, {"tiles": t[:4], "x_ahead": t[4], "overlap": t[5]})
                     for t in sweep]
        entry = wgmma_entry(batch)  # its default tile with a shift a code (the default: three operations a word)
        variants += [(f"wgmma_shifts{list(entry)}", wgmma_out,
                      {"tiles": entry[:4], "x_ahead": entry[4], "overlap": entry[5], "codes3": False})]
        if smem_test["passed"]:
            variants += [(f"smem{list(t)}", smem_out, {"tiles": t}) for t in SMEM_SWEEP.get(batch, [])]
        ref = quant_matmul_ref(xs[HIDDEN].float(), int4[0][2])
        errors = {"bf16_rounding": rel_err(ref.to(torch.bfloat16).float(), ref)}
        row: dict[str, Any] = {"batch": batch, "rel_err": errors}
        for name, one, ov in variants:
            try:
                errors[name] = rel_err(one(kn[0][2], xs[HIDDEN], arrivals=arrivals[0][2], **ov).float(), ref)
            except Exception as exc:  # a tile that fails to compile or launch: recorded, the sweep goes on
                row[f"{name}_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        steps = [("bf16", functools.partial(step_bf16, bf16, xs))]
        steps += [(name, functools.partial(step_each, one, kn, xs, arrivals, **ov)) for name, one, ov in variants
                  if f"{name}_error" not in row]
        time_steps(row, steps)
        mark_best(row, "wgmma")
        mark_best(row, "smem")
        print("wgmma", row, flush=True)
        out["cases"].append(row)
    return out
