"""Router scoring overhead: a 32k-token prompt over 64 prefill workers (memory index, full-prefix overlap for a
worst-case walk), reporting p50/p99 of (a) index lookup + cost scoring and (b) block hashing, separately.

    python -m bench.router_overhead [--tokens 32768] [--workers 64] [--iters 300] [--output-json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench.harness.records import cpu_name, write_json
from bench.harness.timing import nearest_rank
from cluster.routing.events import AllBlocksCleared, BlocksStored, EventBatch, WorkerLoad
from cluster.routing.index import MemoryIndex
from cluster.routing.policy import WorkerView, make_policy
from engine.core.block_hash import BlockHasher


def loaded_index(hashes: list[int], workers: list[str]) -> MemoryIndex:
    """Worker i caches a prefix of a different length; the odd ones hold all of it."""
    index = MemoryIndex(liveness_ttl_s=3600)
    for i, wid in enumerate(workers):
        keep = len(hashes) if i % 2 else (i * len(hashes)) // len(workers)
        index.apply(EventBatch(wid, 1, 0, (AllBlocksCleared(), BlocksStored(tuple(hashes[:keep])))))
    return index


def measure(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(0)
    tokens = [rng.randrange(50000) for _ in range(args.tokens)]
    hasher = BlockHasher.for_model("bench-model", args.block_size)
    hashes = hasher.hash_blocks(tokens)
    workers = [f"w{i}" for i in range(args.workers)]
    index = loaded_index(hashes, workers)
    views = [WorkerView(wid, f"{wid}:1", WorkerLoad(queued_prefill_tokens=rng.randrange(4096),
                                                    kv_cache_usage=rng.random(), num_kv_blocks=4096))
             for wid in workers]
    policy = make_policy("prefix", seed=0)
    score_s, hash_s = [], []
    for _ in range(args.iters):
        start = time.perf_counter()
        hasher.hash_blocks(tokens)
        mid = time.perf_counter()
        policy.choose_prefill(views, index.match(hashes, workers), len(tokens), args.block_size)
        hash_s.append(mid - start)
        score_s.append(time.perf_counter() - mid)
    return {
        "tokens": args.tokens, "workers": args.workers, "block_size": args.block_size, "blocks": len(hashes),
        "iters": args.iters,
        "score_p50_ms": 1e3 * statistics.median(score_s), "score_p99_ms": 1e3 * nearest_rank(score_s, 0.99),
        "hash_p50_ms": 1e3 * statistics.median(hash_s), "hash_p99_ms": 1e3 * nearest_rank(hash_s, 0.99),
        "total_p99_ms": 1e3 * nearest_rank([a + b for a, b in zip(score_s, hash_s, strict=True)], 0.99),
        "cpu": cpu_name(), "python": platform.python_version(),
        "load_average_1m": os.getloadavg()[0],  # other processes on the machine inflate p99
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()
    result = measure(args)
    print(json.dumps(result))
    if args.output_json is not None:
        write_json(args.output_json, result, indent=None)


if __name__ == "__main__":
    main()
