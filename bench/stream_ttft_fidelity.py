"""How far a client that times the first SSE chunk with choices (as `vllm bench serve --backend openai-chat` does)
is from the true first-content time, on a real `kvflow serve --model smollm2` (CPU).

For each request: t_first_chunk (first `data:` chunk with choices: the role chunk) and t_first_content (first
chunk whose delta has content). The error is (t_first_content - t_first_chunk) / t_first_content. Writes
bench/results/stream_ttft_fidelity_cpu.json.

    PYTHONPATH=$PWD python bench/stream_ttft_fidelity.py [--url http://127.0.0.1:8000] [--requests 8]
Without --url it starts its own `kvflow serve` (1 prefill + 1 decode worker) and stops it after.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx

RESULTS = Path(__file__).parent / "results" / "stream_ttft_fidelity_cpu.json"


def measure(url: str, prompt_words: int, max_tokens: int, api_key: str | None) -> dict[str, float]:
    body = {"messages": [{"role": "user", "content": f"Request {time.time()}: " + "lorem ipsum dolor " *
                          (prompt_words // 3)}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    start = time.perf_counter()
    first_chunk = first_content = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if not data.get("choices"):
                continue
            now = time.perf_counter() - start
            first_chunk = now if first_chunk is None else first_chunk
            if first_content is None and data["choices"][0]["delta"].get("content"):
                first_content = now
    assert first_chunk is not None and first_content is not None
    return {"first_chunk_s": first_chunk, "first_content_s": first_content,
            "error": (first_content - first_chunk) / first_content}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", default=None)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-words", type=int, default=300)  # the test server has max_model_len 1024
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    server = None
    if args.url is None:
        from tests.helpers.serve import API_KEY, start_server

        server = start_server(Path(tempfile.mkdtemp()) / "serve.log")
        args.url, args.api_key = next(server).url, API_KEY
    try:
        runs = [measure(args.url, args.prompt_words, args.max_tokens, args.api_key) for _ in range(args.requests)]
    finally:
        if server is not None:
            server.close()
    errors = [r["error"] for r in runs]
    record = {"what": "chat stream: first chunk with choices vs first content (vllm bench serve openai-chat TTFT)",
              "requests": args.requests, "prompt_words": args.prompt_words, "max_tokens": args.max_tokens,
              "first_content_s_median": statistics.median(r["first_content_s"] for r in runs),
              "first_chunk_s_median": statistics.median(r["first_chunk_s"] for r in runs),
              "ttft_error_max": max(errors), "ttft_error_median": statistics.median(errors), "runs": runs}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({k: v for k, v in record.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
