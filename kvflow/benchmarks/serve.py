"""`kvflow bench serve`: online latency/throughput against an OpenAI-compatible /v1/completions endpoint, with
`vllm bench serve`'s JSON field names (mean/median/p90/p99 of TTFT, TPOT, ITL, E2EL in ms, throughputs, goodput).

Datasets: `random` (random token ids), `prefix-repetition` / `shared-prefix` (`--num-prefixes` shared prefixes of
`--prefix-len` tokens, each followed by a unique `--input-len`-token suffix).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from kvflow.benchmarks.lean_http import LeanTransport


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (0 for a single-token answer)."""
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


def make_prompts(dataset: str, num_prompts: int, input_len: int, prefix_len: int, num_prefixes: int,
                 seed: int, vocab: int = 30000) -> list[list[int]]:
    rng = random.Random(seed)
    tokens = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    if dataset == "random":
        return [tokens(input_len) for _ in range(num_prompts)]
    if dataset in ("prefix-repetition", "shared-prefix"):
        prefixes = [tokens(prefix_len) for _ in range(max(num_prefixes, 1))]
        order = [i % len(prefixes) for i in range(num_prompts)]
        rng.shuffle(order)
        return [prefixes[i] + tokens(input_len) for i in order]
    raise ValueError(f"unknown dataset {dataset!r}: random, prefix-repetition or shared-prefix")


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """The JSON payloads of an OpenAI-style server-sent event stream, up to its `[DONE]`; comments and keep-alive
    lines are skipped. Parsed from the bytes as they come (no text decoding and line splitting first): a load
    generator parses every token's event of hundreds of streams."""
    pending = b""
    async for data in response.aiter_bytes():
        pending += data
        if b"\n" not in data:
            continue
        *lines, pending = pending.split(b"\n")
        for line in lines:
            if line.startswith(b"data: ") and line.rstrip(b"\r") != b"data: [DONE]":
                yield json.loads(line[6:])
    if pending.startswith(b"data: ") and pending.rstrip(b"\r") != b"data: [DONE]":
        yield json.loads(pending[6:])


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], output_len: int,
                      api_key: str | None) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    result = RequestResult(ok=False, prompt_tokens=len(prompt))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for data in sse_events(response):
                if "error" in data:
                    result.error = data["error"]["message"]
                    return result
                now = time.perf_counter()
                choices = data.get("choices")
                # A token event: text, or a step's tokens without text (a model served without a tokenizer);
                # the closing event that only carries finish_reason is not one.
                if choices and (choices[0].get("text") or choices[0].get("finish_reason") is None):
                    if result.ttft_s == 0.0:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                if data.get("usage"):
                    result.output_tokens = data["usage"]["completion_tokens"]
        result.e2e_s = time.perf_counter() - start
        result.ok = result.ttft_s > 0
    except httpx.HTTPError as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def http_client() -> httpx.AsyncClient:
    """The load generator's client: httpx over `lean_http.LeanTransport` (a connection per request, no pool, so
    no connection limit either, as vLLM's bench serve sets none; and a fraction of httpcore's CPU per SSE event,
    which capped one client process at ~7k events/s)."""
    return httpx.AsyncClient(timeout=httpx.Timeout(600.0), transport=LeanTransport())


async def run_benchmark(base_url: str, model: str | None, prompts: list[list[int]], output_len: int,
                        request_rate: float, max_concurrency: int | None, api_key: str | None,
                        seed: int = 0) -> tuple[list[RequestResult], float]:
    base = base_url.rstrip("/")
    async with http_client() as client:
        if model is None:
            headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
            model = (await client.get(f"{base}/v1/models", headers=headers)).json()["data"][0]["id"]
        limit = asyncio.Semaphore(max_concurrency or len(prompts))
        rng = np.random.default_rng(seed)

        async def limited(prompt: list[int]) -> RequestResult:
            async with limit:
                return await one_request(client, f"{base}/v1/completions", model, prompt, output_len, api_key)

        start = time.perf_counter()
        tasks = []
        for prompt in prompts:
            tasks.append(asyncio.create_task(limited(prompt)))
            if request_rate != float("inf"):
                await asyncio.sleep(float(rng.exponential(1.0 / request_rate)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summarize(results: list[RequestResult], duration_s: float, goodput: dict[str, float] | None = None,
              percentiles: tuple[int, ...] = (90, 99)) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out: dict[str, Any] = {"duration": duration_s, "completed": len(ok), "failed": len(results) - len(ok),
                           "total_input_tokens": sum(r.prompt_tokens for r in ok),
                           "total_output_tokens": sum(r.output_tokens for r in ok)}
    out["request_throughput"] = len(ok) / duration_s
    out["output_throughput"] = out["total_output_tokens"] / duration_s
    out["total_token_throughput"] = (out["total_input_tokens"] + out["total_output_tokens"]) / duration_s
    tpot = [r.tpot_s for r in ok if r.output_tokens > 1]
    series = {"ttft": [r.ttft_s for r in ok], "tpot": tpot, "itl": [x for r in ok for x in r.itl_s],
              "e2el": [r.e2e_s for r in ok]}
    for name, values in series.items():
        ms = np.asarray(values or [0.0]) * 1e3
        out[f"mean_{name}_ms"] = float(ms.mean())
        out[f"median_{name}_ms"] = float(np.median(ms))
        out[f"std_{name}_ms"] = float(ms.std())
        for p in percentiles:
            out[f"p{p}_{name}_ms"] = float(np.percentile(ms, p))
    if goodput:
        good = 0
        for r in ok:
            if r.ttft_s * 1e3 <= goodput.get("ttft", float("inf")) and \
                    r.tpot_s * 1e3 <= goodput.get("tpot", float("inf")) and \
                    r.e2e_s * 1e3 <= goodput.get("e2el", float("inf")):
                good += 1
        out["request_goodput"] = good / duration_s
    out["errors"] = sorted({r.error for r in results if r.error})[:5]
    out["_series_ms"] = {k: [v * 1e3 for v in vals] for k, vals in series.items()}
    return out


def parse_goodput(items: list[str] | None) -> dict[str, float] | None:
    if not items:
        return None
    out = {}
    for item in items:
        name, _, value = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not value:
            raise ValueError(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        out[name] = float(value)
    return out


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = summary["_series_ms"]
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.5))
    for ax, name in zip(axes, ("ttft", "tpot", "itl", "e2el"), strict=True):
        values = series[name] or [0.0]
        ax.hist(values, bins=40, color="#3b7dd8")
        ax.axvline(np.median(values), color="k", linestyle="--", label="median")
        ax.axvline(np.percentile(values, 99), color="r", linestyle=":", label="p99")
        ax.set_title(f"{name.upper()} (ms)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_report(summary: dict[str, Any]) -> str:
    lines = [f"Successful requests: {summary['completed']}  failed: {summary['failed']}",
             f"Duration (s): {summary['duration']:.2f}",
             f"Request throughput (req/s): {summary['request_throughput']:.2f}",
             f"Output token throughput (tok/s): {summary['output_throughput']:.2f}",
             f"Total token throughput (tok/s): {summary['total_token_throughput']:.2f}"]
    for name in ("ttft", "tpot", "itl", "e2el"):
        lines.append(f"{name.upper():>5} ms: mean {summary[f'mean_{name}_ms']:.1f}  median "
                     f"{summary[f'median_{name}_ms']:.1f}  p90 {summary[f'p90_{name}_ms']:.1f}  p99 "
                     f"{summary[f'p99_{name}_ms']:.1f}")
    if "request_goodput" in summary:
        lines.append(f"Request goodput (req/s): {summary['request_goodput']:.2f}")
    return "\n".join(lines)
