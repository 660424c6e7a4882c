"""The `kvflow` commands users type: generate, bench throughput, and clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


def kvflow(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvflow.cli", "--log-level", "WARNING", *args],
                          capture_output=True, text=True, timeout=timeout)


def test_generate_chat_answers_paris() -> None:
    result = kvflow("generate", "--model", "smollm2", "--chat", "--kv-cache-memory-bytes", str(64 << 20),
                    "--max-model-len", "512", "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "The capital of France is Paris."


def test_bench_throughput_prints_human_and_json_lines(tmp_path: Path) -> None:
    out = tmp_path / "tp.json"
    result = kvflow("bench", "throughput", "--model", "tiny", "--num-prompts", "6", "--input-len", "20",
                    "--output-len", "7", "--ignore-eos", "--kv-cache-memory-bytes", str(16 << 20),
                    "--output-json", str(out))
    assert result.returncode == 0, result.stderr
    human, line = result.stdout.strip().splitlines()[-2:]
    assert human.startswith("Throughput:")
    record = json.loads(line)
    assert record == json.loads(out.read_text())
    assert record["num_output_tokens"] == 6 * 7
    for key in ("requests_per_s", "output_tok_s", "total_tok_s", "elapsed_s"):
        assert record[key] > 0


def test_bad_arguments_give_a_message_not_a_traceback() -> None:
    result = kvflow("generate", "--model", "no-such-model", "hello")
    assert result.returncode == 2
    assert "no-such-model" in result.stderr and "Traceback" not in result.stderr
    result = kvflow("generate", "--model", "tiny", "--block-size", "3", "hi")
    assert result.returncode == 2 and "block_size" in result.stderr


@pytest.mark.parametrize(("flags", "needle"), [
    (["--slo-itl-ms", "-5"], "--slo-itl-ms"), (["--slo-ttft-ms", "0"], "--slo-ttft-ms"),
    (["--disagg-policy", "sometimes"], "--disagg-policy"), (["--itl-target-ms", "-1"], "--itl-target-ms"),
])
def test_serve_refuses_bad_disaggregation_flags_before_any_worker_starts(flags: list[str], needle: str) -> None:
    result = kvflow("serve", "--model", "tiny", "--load-format", "dummy", *flags)
    assert result.returncode == 2 and needle in result.stderr and "Traceback" not in result.stderr
