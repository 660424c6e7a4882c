"""Hopper machine code of kernels/quant_wgmma_smem.py without a GPU (issue 32): each tile compiled for sm_90 by the
Triton on the path (the device image's 3.6.0: `pip install --target DIR triton==3.6.0`, then `PYTHONPATH=DIR:.`),
with the divisibility the runtime specializes, and its registers, stack, shared memory and main loop (the longest
backward branch that loads weights) read off cuobjdump. Writes bench/results/int4_smem_sass_offline.json's `configs`.

    PYTHONPATH=/tmp/tr36:. python -m bench.sass_offline --out bench/results/int4_smem_sass_offline.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from pathlib import Path
from typing import Any

TILES = [(256, 8, 4, 128), (256, 8, 5, 128), (256, 8, 3, 128), (128, 8, 4, 128), (128, 8, 3, 128), (128, 4, 4, 64),
         (256, 4, 4, 64), (128, 8, 3, 256), (128, 8, 4, 256)]  # (BN, warps, stages, BM)
LOOP_OPS = {"BAR.SYNC": r"BAR\.SYNC", "HGMMA": r"HGMMA", "STS": r"\bSTS", "LDG": r"\bLDG", "LOP3": r"LOP3",
            "FFMA": r"FFMA", "F2FP": r"F2FP", "UTMALDG": r"UTMALDG"}


def cuobjdump(flag: str, cubin: bytes) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def loop_stats(sass: str) -> dict[str, int]:
    """Instruction counts of the main loop: the longest backward branch whose body loads weights (LDG; an
    mbarrier's retry branch can span more, over the epilogue)."""
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]{4})\*/", ln).group(1), 16) for ln in lines]
    best: list[str] = []
    for ln, here in zip(lines, addr, strict=True):
        m = re.search(r"BRA (0x[0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < here:
            body = [b for b, a in zip(lines, addr, strict=True) if int(m.group(1), 16) <= a <= here]
            if any(re.search(LOOP_OPS["LDG"], b) for b in body) and len(body) > len(best):
                best = body
    return {"loop_instructions": len(best)} | {k: sum(bool(re.search(p, ln)) for ln in best)
                                               for k, p in LOOP_OPS.items()}


def compile_tile(bn: int, warps: int, stages: int, bm: int) -> dict[str, Any]:
    """One tile (zero-point kind, bf16, PDL, no split, even N) compiled for sm_90."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    import kernels.quant_wgmma_smem as ks

    sig = {"x_desc": f"tensordesc<bf16[{bm}, 64],{ks.operand_layout()!r}>", "QW": "*i32", "S": "*i16",
           "Off": "*u8", "Y": "*bf16", "M": "i32", "N": "i32", "K": "i32", "ITERS_PER_SPLIT": "i32"}
    consts = {"WL": ks.words_layout(warps, bn), "TL": ks.tile_layout(warps, bn), "GROUP": 128, "KIND": 1,
              "WARPS": warps, "BN": bn, "STAGES": stages, "FP16": False, "PDL": True, "SPLIT": False, "EVEN_N": True,
              "BM": bm}
    sig |= dict.fromkeys(consts, "constexpr")
    names = ks._smem_kernel.arg_names
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ("QW", "S", "Off", "Y", "N", "K")}
    kernel = triton.compile(GluonASTSource(ks._smem_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": warps})
    cubin = kernel.asm["cubin"]
    regs, stack = re.search(r"REG:(\d+).*?STACK:(\d+)", cuobjdump("-res-usage", cubin)).groups()
    stats = loop_stats(cuobjdump("-sass", cubin))
    codes = bn * 64 // (32 * warps)
    return {"registers": int(regs), "stack_bytes": int(stack), "shared_bytes": kernel.metadata.shared,
            "codes_per_thread_per_iteration": codes, **stats,
            "loop_instructions_per_code": round(stats["loop_instructions"] / codes, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="a results file whose `configs` to (re)write")
    args = parser.parse_args()
    configs = {}
    for bn, warps, stages, bm in TILES:
        name = f"BN{bn}_warps{warps}_stages{stages}" + ("" if bm == 16 * warps else f"_BM{bm}")
        configs[name] = row = compile_tile(bn, warps, stages, bm)
        print(name, row, flush=True)
    if args.out:
        doc = json.loads(args.out.read_text()) if args.out.exists() else {}
        args.out.write_text(json.dumps(doc | {"configs": configs}, indent=1) + "\n")


if __name__ == "__main__":
    main()
