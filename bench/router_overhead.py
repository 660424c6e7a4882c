"""Router scoring overhead: a 32k-token prompt over 64 prefill workers (memory index, full-prefix overlap for a
worst-case walk), reporting p50/p99 of (a) index lookup + cost scoring and (b) block hashing, separately.

    .venv/bin/python bench/router_overhead.py [--tokens 32768] [--workers 64] [--iters 300] [--output-json PATH]
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

from cluster.routing.events import AllBlocksCleared, BlocksStored, EventBatch, WorkerLoad
from cluster.routing.index import MemoryIndex
from cluster.routing.policy import WorkerView, make_policy
from engine.core.block_hash import BlockHasher


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()

    rng = random.Random(0)
    tokens = [rng.randrange(50000) for _ in range(args.tokens)]
    hasher = BlockHasher.for_model("bench-model", args.block_size)
    hashes = hasher.hash_blocks(tokens)
    index = MemoryIndex(liveness_ttl_s=3600)
    workers = [f"w{i}" for i in range(args.workers)]
    for i, wid in enumerate(workers):  # worker i caches a prefix of a different length; half hold all of it
        keep = len(hashes) if i % 2 else (i * len(hashes)) // args.workers
        index.apply(EventBatch(wid, 1, 0, (AllBlocksCleared(), BlocksStored(tuple(hashes[:keep])))))
    views = [WorkerView(wid, f"{wid}:1", WorkerLoad(queued_prefill_tokens=rng.randrange(4096),
                                                    kv_cache_usage=rng.random(), num_kv_blocks=4096))
             for wid in workers]
    policy = make_policy("prefix", seed=0)

    score_s, hash_s = [], []
    for _ in range(args.iters):
        start = time.perf_counter()
        hasher.hash_blocks(tokens)
        mid = time.perf_counter()
        matched = index.match(hashes, workers)
        policy.choose_prefill(views, matched, len(tokens), args.block_size)
        end = time.perf_counter()
        hash_s.append(mid - start)
        score_s.append(end - mid)
    result = {
        "tokens": args.tokens, "workers": args.workers, "block_size": args.block_size, "blocks": len(hashes),
        "iters": args.iters,
        "score_p50_ms": 1e3 * statistics.median(score_s), "score_p99_ms": 1e3 * percentile(score_s, 0.99),
        "hash_p50_ms": 1e3 * statistics.median(hash_s), "hash_p99_ms": 1e3 * percentile(hash_s, 0.99),
        "total_p99_ms": 1e3 * percentile([a + b for a, b in zip(score_s, hash_s, strict=True)], 0.99),
        "cpu": platform.processor() or platform.machine(), "python": platform.python_version(),
        "load_average_1m": os.getloadavg()[0],  # other processes on the machine inflate p99
    }
    line = json.dumps(result)
    print(line)
    if args.output_json is not None:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(line + "\n")


if __name__ == "__main__":
    main()
