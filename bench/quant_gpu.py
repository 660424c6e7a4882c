"""Quantization on the GPU (issue 14), each quantized form beside bf16 in the same run, Llama-3.1-8B shapes with
random weights (`--load-format dummy`):

- kv:    paged decode attention, bf16 KV vs fp8 KV, at 8k and 32k context (batch 1 and 16), checked against the
         torch reference; and the block count of each KV dtype in one budget.
- int4:  the decode step's weight GEMMs, int4 vs bf16 (bench/quant_int4.py).

The w8a8_layers part (each decoder linear, Fp8Linear vs bf16; the activation quantization, Triton vs torch) was
retired: it runs at `git checkout be1a1ae`. The w8a8 part (fp8 W8A8 / fp8 KV engine throughput beside bf16, KV
block counts, the Fp8Linear layer's error) was retired: it runs at `git checkout 41306f6`. Writes
bench/results/quant_gpu_<device>.json (fields: workload, device, numbers). `--smoke` runs the same code paths on
CPU at tiny shapes (Triton under its interpreter) and writes bench/results/quant_gpu_smoke.json.

    python -m bench.quant_gpu                        # all parts on a GPU
    python -m bench.quant_gpu --smoke
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # must precede the first `import triton` (the kernels below import it)
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import functools  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from bench.harness.records import RESULTS, device_slug, gpu_name, write_json  # noqa: E402
from bench.harness.timing import wall_seconds  # noqa: E402
from bench.quant_int4 import graph_ms, part_int4, rel_err  # noqa: E402
from kernels.fp8_kv import quantize_fp8  # noqa: E402
from kernels.paged_decode_attention import paged_decode_attention, paged_decode_attention_ref  # noqa: E402

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 4096, 14336, 32, 32, 8, 128  # Llama-3.1-8B
PARTS = ("kv", "int4")


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
    if part == "int4":
        return part_int4(args.smoke)
    return part_kv(args.smoke)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=list(PARTS), choices=list(PARTS))
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
