"""The batch-1 decode step's weight GEMVs alone, timed as the engine runs them, per streaming variant.

For Llama-3.1-8B and Qwen2.5-0.5B layer shapes, every layer's four single-row GEMVs (qkv, o, gate|up, down with
SwiGLU folded in; the residual-add + RMSNorm folded into qkv and gate|up where the engine does it, hidden <= 2048)
run over distinct per-layer weights, so nothing is served from L2, captured in one CUDA graph per variant and
launched with programmatic dependent launch as in the engine. Per variant (kernels/small_gemm.py GemvConfig:
pipelined loads, weight prefetch before `gdc_wait`, L2 evict-first hints): the step's GEMV time and weight read
rate, beside a pure read of as many bytes (torch.sum) and the cuBLAS chain the GEMVs replaced. Then a sweep of
tiles x flags per weight shape (each layer's GEMV of that shape back to back), the step again with each shape's
best, and the vocabulary projection (fused argmax) through the tl.dot kernel vs the GEMV configs. The streaming
variants' outputs must equal each other bit for bit (same tiles, same summation order).

    PYTHONUNBUFFERED=1 python -m bench.gpu_gemv      # prints the record as JSON
    python -m bench.gpu_bench --only gemv            # records it with the other results
"""

from __future__ import annotations

import functools
import itertools
import json
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from bench.harness.ceilings import read_bytes_per_s
from bench.harness.timing import graph_seconds
from kernels.silu_and_mul import silu_and_mul
from kernels.small_gemm import GemvConfig, small_gemm

DEV = torch.device("cuda")
SHAPES = {  # hidden, q + 2 kv columns, intermediate, layers, vocabulary
    "llama8b": (4096, 6144, 14336, 32, 128256),
    "qwen05b": (896, 1152, 4864, 24, 151936),
}
BEFORE = GemvConfig(block_n=8, block_k=512, num_warps=4, prefetch=False)  # the kernel before the tile rule
STREAMING = {  # the default tiles (per shape) with each streaming flag: results must be bit-identical
    "no_flags": GemvConfig(prefetch=False),
    "default": GemvConfig(),
    "pipelined": GemvConfig(pipelined=True),
    "evict_first": GemvConfig(evict_first=True),
    "all_flags": GemvConfig(pipelined=True, evict_first=True),
}
SWEEP_FLAGS = {"prefetch": GemvConfig(), "pipelined_prefetch": GemvConfig(pipelined=True)}
WEIGHTS = ("qkv", "o", "gate_up", "down")
GemvChoice = GemvConfig | dict[str, GemvConfig] | None  # one config, one per weight name, or None: cuBLAS


class Layers:
    """Random bf16 weights of `layers` decoder layers and the step's activations."""

    def __init__(self, hidden: int, qkv: int, inter: int, layers: int, seed: int = 0) -> None:
        g = torch.Generator(device=DEV).manual_seed(seed)

        def w(n: int, k: int) -> torch.Tensor:
            return (torch.randn(n, k, generator=g, device=DEV) / k**0.5).to(torch.bfloat16)

        self.hidden, self.fuse_norm = hidden, hidden <= 2048
        self.weights = [{"qkv": w(qkv, hidden), "o": w(hidden, hidden), "gate_up": w(2 * inter, hidden),
                         "down": w(hidden, inter)} for _ in range(layers)]
        self.norm_w = (1 + 0.1 * torch.randn(hidden, generator=g, device=DEV)).to(torch.bfloat16)
        self.x = torch.randn(1, hidden, generator=g, device=DEV).to(torch.bfloat16)
        self.residual = torch.randn(1, hidden, generator=g, device=DEV).to(torch.bfloat16)
        self.out: torch.Tensor | None = None

    def weight_bytes(self, names: tuple[str, ...] = WEIGHTS) -> int:
        return sum(lw[n].numel() * 2 for lw in self.weights for n in names)

    def step(self, cfg: GemvChoice) -> None:
        """The step's GEMVs (cfg None: cuBLAS with the separate SwiGLU kernel); the last output is kept."""
        h = self.x
        for lw in self.weights:
            qkv = self._linear("qkv", h, lw["qkv"], cfg)
            o = self._linear("o", qkv[:, : self.hidden], lw["o"], cfg)
            gate_up = self._linear("gate_up", o, lw["gate_up"], cfg)
            h = self._linear("down", gate_up, lw["down"], cfg)
        self.out = h

    def one_shape(self, name: str, cfg: GemvConfig) -> None:
        """Every layer's `name` GEMV back to back (the same input each time)."""
        k = self.weights[0][name].shape[1]
        x = self.x if k == self.hidden else torch.zeros(1, 2 * k, device=DEV, dtype=torch.bfloat16)
        for lw in self.weights:
            self._linear(name, x, lw[name], cfg)

    def _linear(self, name: str, x: torch.Tensor, w: torch.Tensor, cfg: GemvChoice) -> torch.Tensor:
        silu, norm = name == "down", self.fuse_norm and name in ("qkv", "gate_up")
        if cfg is None:
            return F.linear(silu_and_mul(x) if silu else x, w)
        if isinstance(cfg, dict):
            cfg = cfg[name]
        if norm:
            return small_gemm(x, w, prologue="norm", residual=self.residual, norm_weight=self.norm_w, impl="gemv",
                              gemv=cfg)[0]
        return small_gemm(x, w, prologue="silu" if silu else "none", impl="gemv", gemv=cfg)[0]


def sweep_configs() -> dict[str, GemvConfig]:
    configs = {}
    for (flags, base), bn, bk, nw in itertools.product(SWEEP_FLAGS.items(), (2, 4, 8), (512, 1024, 2048), (4, 8)):
        configs[f"{bn}x{bk}x{nw}_{flags}"] = replace(base, block_n=bn, block_k=bk, num_warps=nw)
    return configs


def gemv_stream_record() -> tuple[dict[str, Any], list[tuple[str, bool, str]]]:
    """({workload: gemv_stream, per model: rates per variant}, [(check name, ok, detail)])."""
    record: dict[str, Any] = {"workload": "gemv_stream"}
    checks = []
    for label, (hidden, qkv, inter, num_layers, vocab) in SHAPES.items():
        layers = Layers(hidden, qkv, inter, num_layers)
        record[label], check = _model_entry(label, layers)
        checks.append(check)
        record[label]["lm_head"] = _lm_head_entry(hidden, vocab)
        if os.environ.get("OUT"):  # partial results survive a timeout
            Path(os.environ["OUT"], "gemv_stream.json").write_text(json.dumps(record, indent=1))
        del layers
        torch.cuda.empty_cache()
    return record, checks


def _variants_check(label: str, layers: Layers) -> tuple[str, bool, str]:
    outputs = {}
    for name, cfg in STREAMING.items():
        layers.step(cfg)
        outputs[name] = layers.out.clone()  # type: ignore[union-attr]
    same = [n for n in STREAMING if torch.equal(outputs[n], outputs["no_flags"])]
    return (f"gemv_stream_variants_bit_equal_{label}", len(same) == len(STREAMING),
            f"{len(same)}/{len(STREAMING)} streaming variants bit-identical to the one without flags")


def _shape_sweep(label: str, layers: Layers) -> dict[str, dict[str, float]]:
    """Per weight shape, every sweep config's µs per call, fastest first."""
    sweep: dict[str, dict[str, float]] = {}
    configs = sweep_configs()
    for wname in WEIGHTS:
        times = {name: round(1e6 * graph_seconds(functools.partial(layers.one_shape, wname, cfg))
                             / len(layers.weights), 2) for name, cfg in configs.items()}
        sweep[wname] = dict(sorted(times.items(), key=lambda kv: kv[1]))
        best_us = next(iter(sweep[wname].values()))
        wbytes = layers.weight_bytes((wname,)) / len(layers.weights)
        print(f"gemv_stream {label} {wname}: best {list(sweep[wname].items())[:5]} ({wbytes / best_us / 1e3:.0f} "
              "GB/s)", flush=True)
    return sweep


def _model_entry(label: str, layers: Layers) -> tuple[dict[str, Any], tuple[str, bool, str]]:
    nbytes = layers.weight_bytes()
    entry: dict[str, Any] = {"weight_bytes": nbytes, "read_gbps": read_bytes_per_s(nbytes) / 1e9,
                             "norm_fused": layers.fuse_norm}

    def chain(name: str, cfg: GemvChoice) -> None:
        t = graph_seconds(functools.partial(layers.step, cfg))
        entry[name] = {"us": round(1e6 * t, 1), "gbps": round(nbytes / t / 1e9, 1)}
        print(f"gemv_stream {label} {name}: {entry[name]}", flush=True)

    chain("cublas", None)
    chain("before", BEFORE)
    for name, cfg in STREAMING.items():
        chain(name, cfg)
    check = _variants_check(label, layers)
    sweep = entry["sweep_us_per_call"] = _shape_sweep(label, layers)
    entry["best_per_shape"] = {w: next(iter(sweep[w])) for w in sweep}
    configs = sweep_configs()
    chain("best_per_shape", {w: configs[name] for w, name in entry["best_per_shape"].items()})
    return entry, check


def _lm_head_entry(hidden: int, vocab: int) -> dict[str, float]:
    """The vocabulary projection with the fused argmax: the engine's tl.dot kernel vs the GEMV configs."""
    g = torch.Generator(device=DEV).manual_seed(1)
    w = (torch.randn(vocab, hidden, generator=g, device=DEV) / hidden**0.5).to(torch.bfloat16)
    x = torch.randn(1, hidden, generator=g, device=DEV).to(torch.bfloat16)
    logits = torch.empty(1, vocab, device=DEV)
    head = functools.partial(small_gemm, x, w, out=logits, argmax=True)
    times = {"dot": graph_seconds(head), "gemv_default": graph_seconds(functools.partial(head, impl="gemv"))}
    for name, cfg in sweep_configs().items():
        times[name] = graph_seconds(functools.partial(head, impl="gemv", gemv=cfg))
    ranked = dict(sorted(((k, round(1e6 * v, 2)) for k, v in times.items()), key=lambda kv: kv[1]))
    print(f"gemv_stream lm_head {vocab}x{hidden}: dot {ranked['dot']} us, best {list(ranked.items())[:4]}",
          flush=True)
    return ranked


if __name__ == "__main__":
    rec, chk = gemv_stream_record()
    print(json.dumps(rec, indent=1))
    for name, ok, detail in chk:
        print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")
