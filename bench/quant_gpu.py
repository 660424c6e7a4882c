"""Quantization on the GPU (issue 14), each quantized form beside bf16 in the same run, Llama-3.1-8B shapes with
random weights (`--load-format dummy`):

- w8a8:  `--quantization fp8` vs bf16, engine throughput on N prompts x 512 in / 128 out (default N=1000; the
         lead may scale it down with --num-prompts), plus fp8 KV alone and fp8 weights + fp8 KV; the KV block
         count of each engine; and the Fp8Linear layer against its float32 reference at a real shape.
- kv:    paged decode attention, bf16 KV vs fp8 KV, at 8k and 32k context (batch 1 and 16), checked against the
         torch reference; and the block count of each KV dtype in one budget.
- int4:  the decode step's weight GEMMs, int4 vs bf16 (bench/quant_int4.py).

The w8a8_layers part (each decoder linear, Fp8Linear vs bf16; the activation quantization, Triton vs torch) was
retired: it runs at `git checkout be1a1ae`. Writes bench/results/quant_gpu_<device>.json (fields: workload, device,
numbers). `--smoke` runs the same code paths on CPU at tiny shapes (Triton under its interpreter; fp8 W8A8 as the layer alone, since the engine refuses
fp8 weights on CPU) and writes bench/results/quant_gpu_smoke.json.

    python -m bench.quant_gpu                        # all parts on a GPU
    python -m bench.quant_gpu --parts w8a8 --num-prompts 256
    python -m bench.quant_gpu --smoke
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # must precede the first `import triton` (the kernels below import it)
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import functools  # noqa: E402
import random  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from bench.harness.records import RESULTS, device_slug, gpu_name, write_json  # noqa: E402
from bench.harness.runs import timed_generate  # noqa: E402
from bench.harness.timing import wall_seconds  # noqa: E402
from bench.quant_int4 import graph_ms, part_int4, rel_err  # noqa: E402
from engine.quant.fp8_linear import Fp8Linear, fp8_matmul_ref  # noqa: E402
from kernels.fp8_kv import quantize_fp8  # noqa: E402
from kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref  # noqa: E402

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 32, 8, 128  # Llama-3.1-8B
PARTS = ("w8a8", "kv", "int4")


# ------------------------------------------------------------------------------------------------ fp8 W8A8
def fp8_layer_errors(smoke: bool) -> dict[str, float]:
    dev = "cpu" if smoke else "cuda"
    n, k = (32, 64) if smoke else (INTER, HIDDEN)
    g = torch.Generator(device="cpu").manual_seed(0)
    dense = torch.nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
    with torch.no_grad():
        dense.weight.copy_((torch.randn(n, k, generator=g) * 0.02).to(dev))
    layer = Fp8Linear.from_dense(dense)
    x = (torch.randn(64, k, generator=g)).to(dev, torch.bfloat16)
    return {"layer_rel_err_vs_ref": rel_err(layer(x), fp8_matmul_ref(x, layer.weight, layer.weight_scale)),
            "layer_rel_err_vs_bf16": rel_err(layer(x), dense(x))}


def part_w8a8(smoke: bool, num_prompts: int, only: list[str] | None = None) -> dict[str, Any]:
    from kvflow import LLM, SamplingParams

    record: dict[str, Any] = fp8_layer_errors(smoke)
    model = "tiny" if smoke else "llama-3.1-8b"
    in_len, out_len = (16, 8) if smoke else (512, 128)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 500 if smoke else 120000) for _ in range(in_len)]}
               for _ in range(num_prompts)]
    configs = {"bf16": {}, "fp8_kv": {"kv_cache_dtype": "fp8"}}
    if not smoke:  # the engine refuses fp8 weights on CPU (the layer above ran there)
        configs |= {"fp8_w8a8": {"quantization": "fp8"},
                    "fp8_w8a8+fp8_kv": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}
    runs: dict[str, Any] = {}
    for name, kw in configs.items():
        if only and name not in only and name != "bf16":
            continue
        llm = LLM(model, load_format="dummy", max_model_len=in_len + out_len + 16, **kw,
                  **({"device": "cpu", "kv_cache_memory_bytes": 16 << 20} if smoke else {}))
        blocks = llm.llm_engine.runner.kv_caches[0][0].shape[0]
        llm.generate(prompts[: min(8, num_prompts)], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        seconds = timed_generate(llm, prompts, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))[1]
        runs[name] = {"output_tok_s": round(num_prompts * out_len / seconds, 1), "seconds": round(seconds, 2),
                      "kv_blocks": int(blocks)}
        print("w8a8", name, runs[name], flush=True)
        del llm
        if not smoke:
            torch.cuda.empty_cache()
    for r in runs.values():
        r["vs_bf16"] = round(r["output_tok_s"] / runs["bf16"]["output_tok_s"], 3)
        r["kv_blocks_vs_bf16"] = round(r["kv_blocks"] / runs["bf16"]["kv_blocks"], 3)
    record.update(workload=f"{model} dummy weights, {num_prompts} prompts x {in_len} in / {out_len} out, "
                           "ignore_eos, engine defaults", runs=runs)
    return record


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
    if part == "w8a8":
        return part_w8a8(args.smoke, 4 if args.smoke else args.num_prompts, args.w8a8_configs)
    if part == "int4":
        return part_int4(args.smoke)
    return part_kv(args.smoke)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--w8a8-configs", nargs="+", default=None,
                        help="w8a8: only these engines beside bf16 (fp8_kv, fp8_w8a8, fp8_w8a8+fp8_kv)")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
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
    write_json(args.out or RESULTS / f"quant_gpu_{tag}.json", record)
    if any("error" in v for v in record.values() if isinstance(v, dict)):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
