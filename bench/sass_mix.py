"""The int4 kn GEMV's sm_90 machine code, compiled here without a GPU: per tile and form, the registers each thread
holds, the instructions of the main loop per 4-bit code, and the opcode mix. For choosing what to time on a GPU
before a device run, not instead of one: the measured sweep (quant_gpu_h100.json int4.kn_gemv_sweep) is set
beside each tile, and it shows that fewer instructions alone do not make a faster kernel (64 x 2 runs 5.6
instructions per code against the default's 7.2, with as many registers, and was 14 % slower).

Triton compiles to PTX and ptxas (shipped with Triton) to a cubin for GPUTarget("cuda", 90, 32); cuobjdump
prints its SASS and resource use. The main loop is the longest backward branch.

    python bench/sass_mix.py                    # -> bench/results/int4_gemv_sass_offline.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import kernels.quant_gemm_kn as kn

ROOT = Path(__file__).resolve().parents[1]
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
SIGNATURE = {"X": "*bf16", "QW": "*i32", "S": "*i16", "Off": "*i16", "Y": "*bf16", "P": "*fp32", "Arrivals": "*i32",
             "N": "i32", "K": "i32", "K_PER_SPLIT": "i32", "NUM_SPLITS": "i32"}
INSTRUCTION = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);")
RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
REGISTERS_PER_SM = 65536
# (BLOCK_N, NSUB, programs per SM, warps): the default, the tiles the H100 sweeps timed, and narrower ones
TILES = [(32, 4, 16, 1), (32, 4, 12, 1), (32, 2, 16, 1), (32, 8, 16, 1), (16, 4, 16, 1), (16, 8, 16, 1),
         (64, 2, 16, 1), (64, 4, 16, 1)]


def compile_gemv(tiles: tuple[int, int, int, int], pairs: bool, kind: int, group: int, workdir: Path) -> str:
    block_n, nsub, _, warps = tiles
    constants = {"GROUP": group, "KIND": kind, "BLOCK_N": block_n, "NSUB": nsub, "ASM": True, "PDL": True,
                 "PIPELINE": True, "SUM_HERE": True, "PAIRS": pairs}
    fn = kn._kn_gemv_kernel
    signature = dict(SIGNATURE) | {name: "constexpr" for name in constants}
    source = ASTSource(fn=fn, signature=signature,
                       constexprs={(fn.arg_names.index(k),): v for k, v in constants.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    cubin = workdir / "gemv.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    return str(cubin)


def main_loop(sass: str) -> list[str]:
    """Opcodes of the longest loop: from a backward branch's target to the branch."""
    listing = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in map(INSTRUCTION.match, sass.splitlines()) if m]
    best: list[str] = []
    for address, opcode, operands in listing:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:
            body = [op for a, op, _ in listing if int(target.group(1), 16) <= a <= address]
            best = max(best, body, key=len)
    return best


def measured_ms(sweep: dict[str, Any]) -> dict[tuple[int, ...], float]:
    """Median step time per tile of the H100 sweeps (single-nibble form, codes loaded ahead)."""
    times: dict[tuple[int, ...], list[float]] = collections.defaultdict(list)
    for rounds in sweep.values():
        for rec in rounds if isinstance(rounds, list) else []:
            if rec.get("pipeline") and "step_ms" in rec:
                times[tuple(rec["gemv_tiles"])].append(rec["step_ms"])
    return {t: statistics.median(v) for t, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", type=int, default=1, help="0 min, 1 zero point (AWQ/GPTQ), 2 symmetric")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "int4_gemv_sass_offline.json")
    args = parser.parse_args()
    h100 = json.loads((ROOT / "bench" / "results" / "quant_gpu_h100.json").read_text())
    measured = measured_ms(h100["int4"]["kn_gemv_sweep"])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for tiles in TILES:
            for pairs in (False, True):
                cubin = compile_gemv(tiles, pairs, args.kind, args.group, Path(tmp))
                sass = subprocess.run([str(CUOBJDUMP), "-sass", cubin], capture_output=True, text=True,
                                      check=True).stdout
                usage = subprocess.run([str(CUOBJDUMP), "-res-usage", cubin], capture_output=True, text=True,
                                       check=True).stdout
                regs, stack, shared, local = (int(g) for g in RESOURCES.search(usage).groups())
                loop = main_loop(sass)
                block_n, nsub, per_sm, warps = tiles
                codes = 32 * nsub * block_n // (32 * warps)  # 4-bit codes per thread per iteration
                mix = collections.Counter(op.split(".")[0] for op in loop)
                row = {"gemv_tiles": list(tiles), "pairs": pairs, "registers": regs, "stack_bytes": stack,
                       "shared_bytes": shared, "local_bytes": local,
                       "warps_per_sm_by_registers": REGISTERS_PER_SM // (max(regs, 1) * 32),
                       "programs_per_sm_asked": per_sm, "loop_instructions": len(loop),
                       "codes_per_thread_per_iteration": codes,
                       "instructions_per_code": round(len(loop) / codes, 2), "opcode_mix": dict(mix.most_common(12))}
                if not pairs and tiles in measured:
                    row["h100_step_ms_measured"] = round(measured[tiles], 3)
                print(json.dumps({k: v for k, v in row.items() if k != "opcode_mix"}), flush=True)
                rows.append(row)
    # One entry per Triton version, kept beside the others: the device image's Triton (3.6.0 on 2026-11-17, the
    # H100 sweeps' compiler) and this project's may compile the same kernel differently.
    record = json.loads(args.out.read_text()) if args.out.exists() else {}
    record.update({"what": "sm_90 SASS of kernels/quant_gemm_kn.py's GEMV, compiled offline (no GPU): registers and "
                           "main-loop instructions per 4-bit code, by tile and form (pairs: the nibble-pair form), "
                           "per Triton version",
                   "kind": args.kind, "group": args.group, "x_dtype": "bfloat16",
                   "command": "python bench/sass_mix.py (another Triton: pip install --target DIR triton==X, "
                              "then PYTHONPATH=DIR python bench/sass_mix.py)"})
    record.setdefault("by_triton", {})[triton.__version__] = {"rows": rows}
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
