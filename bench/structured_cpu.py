"""Structured output on SmolLM2 (CPU): 50 `response_format` json_schema requests (5 schemas x 10 prompts) through
a `kvflow serve` this script starts, once unified (one decode worker, no prefill worker) and once P/D (1 prefill +
1 decode worker, every prompt prefilled remotely: the prefill worker samples the first token under the grammar).
Reports the share of outputs that parse as JSON and validate against their schema, per path.

    PYTHONPATH=. .venv/bin/python bench/structured_cpu.py [--max-tokens 192] [--concurrency 8] \
        [--output-json bench/results/structured_smollm2_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import jsonschema

from cluster.auth import TOKEN_ENV
from kvflow.launcher import free_port

SCHEMAS: dict[str, dict[str, Any]] = {
    "person": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 32}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 32}}, "required": ["name", "age", "city"],
        "additionalProperties": False},
    "product": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40}, "price": {"type": "number", "minimum": 0},
        "in_stock": {"type": "boolean"}, "category": {"type": "string", "enum": ["food", "tools", "books", "toys"]}},
        "required": ["title", "price", "in_stock", "category"], "additionalProperties": False},
    "weather": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 32},
        "temperature_c": {"type": "integer", "minimum": -60, "maximum": 60},
        "conditions": {"type": "string", "enum": ["sunny", "cloudy", "rain", "snow", "fog"]}},
        "required": ["city", "temperature_c", "conditions"], "additionalProperties": False},
    "book": {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 40}, "author": {"type": "string", "maxLength": 32},
        "year": {"type": "integer", "minimum": 1000, "maximum": 2100},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
        "required": ["title", "author", "year", "tags"], "additionalProperties": False},
    "event": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 32}, "day": {"type": "string", "enum": [
            "monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"]},
        "attendees": {"type": "integer", "minimum": 1, "maximum": 10000}, "online": {"type": "boolean"}},
        "required": ["name", "day", "attendees", "online"], "additionalProperties": False},
}
PROMPTS: dict[str, list[str]] = {
    "person": ["Describe a famous scientist.", "Invent a character for a novel.", "Describe your best friend.",
               "Tell me about a chef from Italy.", "Describe a teacher from Japan.", "Who painted the Mona Lisa?",
               "Describe an astronaut.", "Invent a football player.", "Describe a musician from Brazil.",
               "Tell me about a doctor in Kenya."],
    "product": ["Describe a hammer for sale.", "A bag of apples in a shop.", "A children's puzzle game.",
                "A cookbook about French cuisine.", "A cordless drill.", "A box of chocolates.",
                "A wooden toy train.", "A novel about the sea.", "A set of screwdrivers.", "A loaf of bread."],
    "weather": ["What is the weather in Paris today?", "Weather report for Oslo in winter.",
                "Describe the weather in Cairo in summer.", "Is it raining in London?",
                "The weather in Tokyo this morning.", "A foggy day in San Francisco.",
                "Snow in Moscow today.", "A sunny afternoon in Madrid.", "Weather in Sydney right now.",
                "A cloudy day in Berlin."],
    "book": ["Tell me about a classic novel.", "Describe a science fiction book.", "A famous poetry collection.",
             "A history book about Rome.", "A children's book about animals.", "A mystery novel.",
             "A book about cooking.", "A biography of a president.", "A fantasy book with dragons.",
             "A textbook about physics."],
    "event": ["Plan a birthday party.", "Describe a music festival.", "A weekly team meeting.",
              "A charity marathon.", "An online programming workshop.", "A wedding in June.",
              "A book club gathering.", "A science conference.", "A company picnic.", "A chess tournament."],
}
ENGINE = ["--kv-cache-memory-bytes", str(512 << 20), "--max-model-len", "2048"]
PATHS = {"unified": ["--prefill-workers", "0", "--decode-workers", "1"],
         "pd": ["--prefill-workers", "1", "--decode-workers", "1", "--disagg-min-prompt-tokens", "0"]}


def start_server(path: str, log_dir: Path) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    log = log_dir / f"serve_{path}.log"
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "kvflow.cli", "serve", "--model", "smollm2", "--port",
                                    str(port), "--grpc-port", "0", *ENGINE, *PATHS[path]],
                                   stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"kvflow serve exited:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return process, url, log
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"kvflow serve not healthy in time:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def disaggregated_count(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith('kvflow:requests_total{path="disaggregated"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


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
            record: dict[str, Any] = {"schema": schema_name, "prompt": prompt, "status": response.status_code,
                                      "latency_s": round(latency, 3), "parsed": False, "valid": False}
            if response.status_code != 200:
                record["error"] = response.text[:300]
                return record
            choice = response.json()["choices"][0]
            text = choice["message"]["content"]
            record.update(finish_reason=choice["finish_reason"], text=text,
                          completion_tokens=response.json()["usage"]["completion_tokens"])
            try:
                value = json.loads(text)
                record["parsed"] = True
                jsonschema.validate(value, schema)
                record["valid"] = True
            except (ValueError, jsonschema.ValidationError) as exc:
                record["error"] = str(exc)[:300]
            return record

        return await asyncio.gather(*(one(name, p) for name, prompts in PROMPTS.items() for p in prompts))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=192)  # above the schemas' longest output
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--paths", nargs="+", default=list(PATHS), choices=list(PATHS))
    parser.add_argument("--log-dir", type=Path, default=Path("/tmp/kvflow_structured_bench"))
    parser.add_argument("--output-json", type=Path, default=Path("bench/results/structured_smollm2_cpu.json"))
    args = parser.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    num_requests = sum(len(p) for p in PROMPTS.values())
    result: dict[str, Any] = {
        "workload": {"model": "smollm2 (SmolLM2-135M-Instruct, fp32)", "requests": num_requests,
                     "schemas": len(SCHEMAS), "prompts_per_schema": num_requests // len(SCHEMAS),
                     "request": "chat, response_format json_schema, temperature 0",
                     "max_tokens": args.max_tokens, "concurrency": args.concurrency},
        "device": {"kind": "cpu", "processor": platform.processor() or platform.machine(),
                   "cpus": os.cpu_count(), "load_average_at_start": os.getloadavg()},
        "paths": {},
    }
    for path in args.paths:
        process, url, log = start_server(path, args.log_dir)
        try:
            before = disaggregated_count(url)
            started = time.perf_counter()
            records = asyncio.run(run_set(url, args.max_tokens, args.concurrency))
            wall = time.perf_counter() - started
            disaggregated = disaggregated_count(url) - before
        finally:
            process.terminate()
            process.wait(120)
        parsed = sum(r["parsed"] for r in records)
        valid = sum(r["valid"] for r in records)
        finish: dict[str, int] = {}
        for r in records:
            finish[str(r.get("finish_reason"))] = finish.get(str(r.get("finish_reason")), 0) + 1
        result["paths"][path] = {
            "requests": len(records), "parse_fraction": parsed / len(records), "valid_fraction": valid / len(records),
            "disaggregated_requests": disaggregated, "finish_reasons": finish, "wall_s": round(wall, 1),
            "completion_tokens": sum(r.get("completion_tokens", 0) for r in records),
            "failures": [r for r in records if not r["valid"]],
            "samples": [r["text"] for r in records[:: len(PROMPTS["person"])]],
        }
        print(f"{path}: {valid}/{len(records)} valid ({parsed} parse), {disaggregated:.0f} disaggregated, "
              f"{wall:.1f} s, finish {finish}", flush=True)
    args.output_json.parent.mkdir(parents=True, exist_ok=True)
    args.output_json.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output_json}")


if __name__ == "__main__":
    main()
