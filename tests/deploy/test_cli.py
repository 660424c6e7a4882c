"""The `kvflow` commands users type: generate, bench throughput, and clear errors."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvflow.cli import build_parser


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


@pytest.mark.parametrize(("flags", "needle"), [
    (["--model", "/nonexistent"], "/nonexistent"),
    (["--model", "tiny", "--load-format", "dummy", "--quantization", "fp8", "--device", "cpu"], "needs a CUDA GPU"),
    (["--model", "tiny", "--load-format", "dummy", "--max-model-len", "999999"], "max_position_embeddings"),
    (["--model", "tiny", "--load-format", "dummy", "--device", "cpu", "--max-model-len", "512",
      "--kv-cache-memory-bytes", "4096"], "fewer than max_model_len"),
])
def test_serve_refuses_a_bad_engine_config_in_one_line_before_any_worker_starts(flags: list[str],
                                                                                 needle: str) -> None:
    result = kvflow("serve", *flags, "--port", "0")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("kvflow: error: ") and needle in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # no traceback, no worker's log


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


@pytest.mark.parametrize("command", ["serve", "router", "worker", "prefill", "decode", "generate"])
def test_every_flag_has_help_text(command: str) -> None:
    parser = _subparsers(build_parser())[command]
    bare = [action.option_strings[0] if action.option_strings else action.dest for action in parser._actions
            if not action.help and not isinstance(action, argparse._HelpAction)]
    assert not bare, f"kvflow {command}: flags without help text: {bare}"


def test_help_shows_defaults_but_never_one_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLOW_API_KEY", "secret-key-123")
    monkeypatch.setenv("KVFLOW_INDEX_URL", "redis://:secret-pw@host:6379/0")
    commands = _subparsers(build_parser())
    serve_help = commands["serve"].format_help()
    assert "(default: 8000)" in serve_help and "(default: prefix)" in serve_help and "(default: 50051)" in serve_help
    for command in ("serve", "router"):
        text = commands[command].format_help()
        assert "secret" not in text and "$KVFLOW_API_KEY" in text


def test_adaptive_serve_starts_as_replicas_where_two_workers_get_gpus_of_their_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On 2 x H200, adaptive from two replicas met the SLO on mixed and prefill-heavy loads (1.000 / 1.000), from
    1P1D 1.000 / 0.678: the default start on GPUs. Explicit pools, -dp, TP that leaves no room, pinned GPU lists,
    the static policy and CPU keep the 1P1D default."""
    import kvflow.launcher
    from cluster.worker.args import server_engine_args
    from kvflow.commands.serve import adaptive_starts_as_replicas

    def starts(argv: list[str], gpus: int = 2) -> bool:
        monkeypatch.setattr(kvflow.launcher, "visible_gpus", lambda: [str(i) for i in range(gpus)])
        args = build_parser().parse_args(["serve", "--model", "tiny", *argv])
        args.gpu_memory_utilization = 0.9
        engine_args = server_engine_args(args)
        tp = engine_args.tensor_parallel_size
        return adaptive_starts_as_replicas(args, engine_args, tp, tp)

    assert starts([]) and starts(["--device", "cuda"]) and starts(["-tp", "2"], gpus=4)
    assert not starts([], gpus=1) and not starts(["-tp", "2"], gpus=2)
    for flags in (["--prefill-workers", "1"], ["--decode-workers", "1"], ["-dp", "2"], ["--decode-gpus", "0"],
                  ["--disagg-policy", "static"], ["--device", "cpu"]):
        assert not starts(flags), flags
