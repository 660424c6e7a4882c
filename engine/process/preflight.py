"""`python -m engine.process.preflight --processes N [engine flags]`: the engine config a worker would build, checked, and
a CPU worker's memory (engine/process/memory_budget.py), as one JSON line on stdout.

`kvflow serve` runs it before starting any worker, so a bad model path, a quantization the device cannot run, a
max_model_len beyond the model's, or workers the host cannot hold end in one line instead of in every worker's
log. A child process because resolving the model loads engine/models (and may convert a GGUF file), which the
router's process, the launcher's, must not hold for its lifetime (tests/deploy/test_floor_plan.py).

Output: {"error": "<one line>"} for a refused config; {"device": "cuda..."} for GPU workers (they size their own KV
by profiling); {"device": "cpu", "available": bytes or null, "worker": WorkerMemory fields} for CPU workers.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from engine.arg_utils import EngineArgs
from engine.errors import ModelNotAvailable
from engine.process.lifeline import die_with_parent_if_asked
from engine.process.memory_budget import cpu_worker_memory, mem_available_bytes


def check(args: EngineArgs, processes: int, available: int | None) -> dict[str, Any]:
    """Raises ValueError / ModelNotAvailable with the reason, as `create_engine_config` does in a worker."""
    config = args.create_engine_config()
    if config.device.device.startswith("cuda"):
        return {"device": config.device.device}
    worker = cpu_worker_memory(config, processes, available)
    return {"device": config.device.device, "available": available, "worker": dataclasses.asdict(worker)}


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    parser = argparse.ArgumentParser(prog="python -m engine.process.preflight")
    parser.add_argument("--processes", type=int, required=True,
                        help="worker processes sharing this host's memory (workers x tensor-parallel ranks)")
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(argv)
    args = dataclasses.replace(EngineArgs.from_cli_args(ns), usage_context="server")  # a server's batch defaults
    try:
        result = check(args, ns.processes, mem_available_bytes())
    except (ValueError, ModelNotAvailable) as exc:
        result = {"error": str(exc)}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
