"""Structured output on SmolLM2 (CPU): 50 `response_format` json_schema requests (5 schemas x 10 prompts) through
a `kvflow serve` this scenario starts, once unified (one decode worker, no prefill worker) and once P/D (1 prefill +
1 decode worker, every prompt prefilled remotely: the prefill worker samples the first token under the grammar).
Reports the share of outputs that parse as JSON and validate against their schema, per path.

    python -m bench.structured_cpu [--max-tokens 192] [--concurrency 8] \
        [--output-json bench/results/structured_smollm2_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from bench.harness.records import RESULTS, cpu_name, write_json
from bench.harness.serving import metric_total
from cluster.auth import TOKEN_ENV
from kvflow.benchmarks.server import ServerProcess

# The five JSON schemas and each one's ten prompts.
REQUESTS = json.loads((Path(__file__).resolve().parent / "data" / "structured_requests.json").read_text())
SCHEMAS: dict[str, dict[str, Any]] = REQUESTS["schemas"]
PROMPTS: dict[str, list[str]] = REQUESTS["prompts"]
ENGINE = ["--kv-cache-memory-bytes", str(512 << 20), "--max-model-len", "2048"]
PATHS = {"unified": ["--prefill-workers", "0", "--decode-workers", "1"],
         "pd": ["--prefill-workers", "1", "--decode-workers", "1", "--disagg-min-prompt-tokens", "0"]}


DISAGGREGATED = 'kvflow:requests_total{path="disaggregated"}'


def checked(response: httpx.Response, record: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """`record` with the answer, and whether it parses as JSON and validates against `schema`."""
    if response.status_code != 200:
        return {**record, "error": response.text[:300]}
    choice0 = response.json()["choices"][0]
    text_out = choice0["message"]["content"]
    record.update(finish_reason=choice0["finish_reason"], text=text_out,
                  completion_tokens=response.json()["usage"]["completion_tokens"])
    try:
        value = json.loads(text_out)
        record["parsed"] = True
        jsonschema.validate(value, schema)
        record["valid"] = True
    except (ValueError, jsonschema.ValidationError) as exc:
        record["error"] = str(exc)[:300]
    return record


async def run_set(url: str, max_tokens: int, concurrency: int) -> list[dict[str, Any]]:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=900) as client:

        async def one(schema_name: str, prompt: str) -> dict[str, Any]:
            schema = SCHEMAS[schema_name]
            body = {"model": "smollm2", "temperature": 0, "max_tokens": max_tokens,
                    "messages": [{"role": "system", "content": "Answer with a JSON object."},
                                 {"role": "user", "content": prompt}],
                    "response_format": {"type": "json_schema", "json_schema": {"name": schema_name,
                                                                                "schema": schema}}}
            async with gate:
                started = time.perf_counter()
                response = await client.post(f"{url}/v1/chat/completions", json=body)
                latency = time.perf_counter() - started
            return checked(response, {"schema": schema_name, "prompt": prompt, "status": response.status_code,
                                      "latency_s": round(latency, 3), "parsed": False, "valid": False}, schema)

        return await asyncio.gather(*(one(name, p) for name, prompts in PROMPTS.items() for p in prompts))


def run_path(path: str, log_dir: Path, max_tokens: int, concurrency: int) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}  # serve makes its own cluster token
    server = ServerProcess.kvflow("serve", "--model", "smollm2", *ENGINE, *PATHS[path], env=env,
                                  log_path=log_dir / f"serve_{path}.log")
    try:
        server.wait_ready(600)
        before = metric_total(server.url, DISAGGREGATED)
        started = time.perf_counter()
        records = asyncio.run(run_set(server.url, max_tokens, concurrency))
        wall = time.perf_counter() - started
        disaggregated = metric_total(server.url, DISAGGREGATED) - before
    finally:
        server.stop(120)
    parsed, valid = sum(r["parsed"] for r in records), sum(r["valid"] for r in records)
    finish = dict(Counter(str(r.get("finish_reason")) for r in records))
    print(f"{path}: {valid}/{len(records)} valid ({parsed} parse), {disaggregated:.0f} disaggregated, "
          f"{wall:.1f} s, finish {finish}", flush=True)
    return {"requests": len(records), "parse_fraction": parsed / len(records), "valid_fraction": valid / len(records),
            "disaggregated_requests": disaggregated, "finish_reasons": finish, "wall_s": round(wall, 1),
            "completion_tokens": sum(r.get("completion_tokens", 0) for r in records),
            "failures": [r for r in records if not r["valid"]],
            "samples": [r["text"] for r in records[:: len(PROMPTS["person"])]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=192)  # above the schemas' longest output
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/kvflow_structured_bench"))
    parser.add_argument("--output-json", type=Path, default=RESULTS / "structured_smollm2_cpu.json")
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    num_requests = sum(len(p) for p in PROMPTS.values())
    result: dict[str, Any] = {
        "workload": {"model": "smollm2 (SmolLM2-135M-Instruct, fp32)", "requests": num_requests,
                     "schemas": len(SCHEMAS), "prompts_per_schema": num_requests // len(SCHEMAS),
                     "request": "chat, response_format json_schema, temperature 0",
                     "max_tokens": args.max_tokens, "concurrency": args.concurrency},
        "device": {"kind": "cpu", "processor": cpu_name(), "cpus": os.cpu_count(),
                   "load_average_at_start": os.getloadavg()},
        "paths": {path: run_path(path, args.log_dir, args.max_tokens, args.concurrency) for path in args.paths},
    }
    write_json(args.output_json, result)


if __name__ == "__main__":
    main()
