"""What a full cyclic-garbage collection costs a worker process, before and after `gc.freeze()` of its start-up heap
(engine/process/gc_heap.py, which every worker server and tensor-parallel rank now runs once started).

Builds the engine in this process as a worker does, then times `gc.collect()` (a full, oldest-generation
collection: the one that walks every tracked object) `--repeats` times before the freeze and after it. Python runs
such a collection on its own whenever enough objects have survived younger ones, on whichever thread allocates, so
its duration is a pause in every running request's token stream.

    python -m bench.gc_pause --model smollm2 --out bench/results
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path

from bench.harness.records import RESULTS, cpu_name, gpu_name, write_json


def full_collection_ms(repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        out.append(round((time.perf_counter() - started) * 1e3, 2))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--load-format", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    from kvflow import LLM

    llm = LLM(model=args.model, load_format=args.load_format, device=args.device,
              kv_cache_memory_bytes=1 << 27, max_model_len=1024)
    tracked = len(gc.get_objects())
    before = full_collection_ms(args.repeats)
    gc.freeze()
    after = full_collection_ms(args.repeats)
    device = llm.llm_engine.device.type
    record = {"workload": f"{args.model} engine built in-process, then gc.collect() x {args.repeats}",
              "device": gpu_name() if device == "cuda" else cpu_name(), "tracked_objects": tracked,
              "full_collection_ms_before_freeze": before, "full_collection_ms_after_freeze": after,
              "load_average": os.getloadavg()}
    llm.close()
    write_json(args.out / f"gc_pause_{device}_{args.model.replace('/', '_')}.json", record)


if __name__ == "__main__":
    main()
