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
from cluster.auth import TOKEN_ENV
from kvflow.benchmarks.server import ServerProcess


def text(max_length: int) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length}


def integer(minimum: int, maximum: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": minimum, "maximum": maximum}


def choice(*values: str) -> dict[str, Any]:
    return {"type": "string", "enum": list(values)}


def closed_object(**properties: dict[str, Any]) -> dict[str, Any]:
    """An object with exactly these properties, all required."""
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}


BOOLEAN = {"type": "boolean"}
SCHEMAS: dict[str, dict[str, Any]] = {
    "person": closed_object(name=text(32), age=integer(0, 120), city=text(32)),
    "product": closed_object(title=text(40), price={"type": "number", "minimum": 0}, in_stock=BOOLEAN,
                             category=choice("food", "tools", "books", "toys")),
    "weather": closed_object(city=text(32), temperature_c=integer(-60, 60),
                             conditions=choice("sunny", "cloudy", "rain", "snow", "fog")),
    "book": closed_object(title=text(40), author=text(32), year=integer(1000, 2100),
                          tags={"type": "array", "items": text(16), "maxItems": 3}),
    "event": closed_object(name=text(32), day=choice("monday", "tuesday", "wednesday", "thursday", "friday",
                                                     "saturday", "sunday"),
                           attendees=integer(1, 10000), online=BOOLEAN),
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


def disaggregated_count(url: str) -> float:
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith('kvflow:requests_total{path="disaggregated"}'):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


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
        before = disaggregated_count(server.url)
        started = time.perf_counter()
        records = asyncio.run(run_set(server.url, max_tokens, concurrency))
        wall = time.perf_counter() - started
        disaggregated = disaggregated_count(server.url) - before
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
