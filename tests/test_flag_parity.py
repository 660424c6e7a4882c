"""vLLM flag parity, in-process (no worker starts): every flag of `vllm serve` (tests/data/vllm_serve_flags.txt) is
either defined by `kvflow serve` or refused with one line and exit code 2; vLLM's spellings (underscores,
`--flag true/false`) on every sub-command; --generation-config / --override-generation-config, max_new_tokens as a
cap, and LLM.get_default_sampling_params()."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvflow.cli import build_parser, main
from kvflow.commands.flag_compat import FlagRefused, prepare_argv
from kvflow.commands.unsupported_flags import IN_PROGRESS, UNSUPPORTED

FLAGS_FILE = Path(__file__).parent / "data" / "vllm_serve_flags.txt"


def vllm_flags() -> list[str]:
    flags = []
    for line in FLAGS_FILE.read_text().splitlines():
        if line and not line.startswith("#"):
            flags += line.split()
    return flags


def serve_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["serve"]


@pytest.fixture(scope="module")
def parser() -> argparse.ArgumentParser:
    return build_parser()


def test_every_vllm_serve_flag_is_defined_or_refused_in_one_line(parser: argparse.ArgumentParser) -> None:
    known = serve_parser(parser)._option_string_actions
    flags = vllm_flags()
    assert len(flags) >= 111
    accepted, refused = [], []
    for flag in flags:
        if flag in known:
            accepted.append(flag)
            continue
        with pytest.raises(FlagRefused) as caught:
            prepare_argv(parser, ["serve", "--model", "smollm2", flag, "1"])
        line = str(caught.value)
        assert "\n" not in line and line.startswith(f"`{flag}` is not supported by kvflow (") and line.endswith(")")
        refused.append(flag)
    assert len(accepted) >= 30 and len(accepted) + len(refused) == len(flags)
    # no refusal row shadows a flag kvflow defines (the parser's own flag always wins anyway)
    assert not (set(UNSUPPORTED) & set(known))


def test_refusal_through_main_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", "smollm2", "--limit-mm-per-prompt", "image=2"]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        "`--limit-mm-per-prompt` is not supported by kvflow (kvflow serves text-only models: there is no "
        "multimodal input to limit or process)"]
    assert "unrecognized arguments" not in err and "Traceback" not in err
    for argv in (["serve", "--enable_lora"], ["serve", "--guided_decoding_backend", "xgrammar"],
                 ["prefill", "--tool-call-parser=hermes"], ["decode", "--structured-outputs-config", "{}"],
                 ["generate", "hi", "--no-enable-lora"]):
        assert main(argv) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_flags_other_branches_add_win_over_the_refusal(parser: argparse.ArgumentParser) -> None:
    """A flag the real parser defines is never refused: the table is only the fallback."""
    for merged in ("--tensor-parallel-size", "--kv-cache-dtype", "--cpu-offload-gb"):  # merged since
        assert merged not in IN_PROGRESS
    assert prepare_argv(parser, ["serve", "--tensor_parallel_size", "1", "--cpu_offload_gb", "0"]) == [
        "serve", "--tensor-parallel-size", "1", "--cpu-offload-gb", "0"]
    assert "--guided-decoding-backend" in IN_PROGRESS
    fresh = build_parser()
    serve_parser(fresh).add_argument("--guided-decoding-backend", default="xgrammar")  # as a branch would
    args = fresh.parse_args(prepare_argv(fresh, ["serve", "--guided_decoding_backend", "guidance"]))
    assert args.guided_decoding_backend == "guidance"


@pytest.mark.parametrize(("given", "field", "value"), [
    (["--enforce-eager"], "enforce_eager", True),
    (["--enforce-eager", "True"], "enforce_eager", True),
    (["--enforce_eager", "false"], "enforce_eager", False),
    (["--enforce-eager=0"], "enforce_eager", False),
    (["--enable-chunked-prefill", "False"], "enable_chunked_prefill", False),
    (["--enable_chunked_prefill", "1"], "enable_chunked_prefill", True),
    (["--no-enable-prefix-caching"], "enable_prefix_caching", False),
    (["--enable-prefix-caching=FALSE"], "enable_prefix_caching", False),
    (["--disable-log-stats", "true"], "disable_log_stats", True),
    (["--disable-log-stats", "false"], "disable_log_stats", False),
    (["--max_num_seqs", "7"], "max_num_seqs", 7),
    (["--max_model_len=512"], "max_model_len", 512),
    (["--gpu_memory_utilization", "0.5"], "gpu_memory_utilization", 0.5),
])
def test_vllm_spellings_on_serve(parser: argparse.ArgumentParser, given: list[str], field: str,
                                 value: object) -> None:
    args = parser.parse_args(prepare_argv(parser, ["serve", *given]))
    assert getattr(args, field) == value


def test_vllm_spellings_on_workers_generate_and_bench(parser: argparse.ArgumentParser) -> None:
    args = parser.parse_args(prepare_argv(parser, ["decode", "--port", "1", "--max_num_batched_tokens", "64",
                                                   "--enable-prefix-caching", "false"]))
    assert args.max_num_batched_tokens == 64 and args.enable_prefix_caching is False
    args = parser.parse_args(prepare_argv(parser, ["prefill", "--port", "1", "--enforce_eager", "True"]))
    assert args.enforce_eager is True
    args = parser.parse_args(prepare_argv(parser, ["generate", "--chat", "What is 2+2?", "--max_tokens", "3"]))
    assert args.chat is True and args.prompt == "What is 2+2?" and args.max_tokens == 3  # the prompt stays
    args = parser.parse_args(prepare_argv(parser, ["bench", "throughput", "--ignore_eos", "true"]))
    assert args.ignore_eos is True
    with pytest.raises(FlagRefused, match="true/false"):
        prepare_argv(parser, ["serve", "--enforce-eager=maybe"])


def test_generation_config_folder_override_and_cap(tmp_path: Path) -> None:
    from kvflow import LLM, SamplingParams

    folder = tmp_path / "gen"
    folder.mkdir()
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_p": 0.9,
                                                               "max_new_tokens": 5}))
    llm = LLM("tiny", max_model_len=64, kv_cache_memory_bytes=8 << 20, generation_config=str(folder),
              override_generation_config={"top_k": 7})
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_p, defaults.top_k, defaults.max_tokens) == (0.3, 0.9, 7, 5)
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=40, ignore_eos=True,
                                                                          temperature=0))
    assert len(out[0].outputs[0].token_ids) == 5  # max_new_tokens caps the request's max_tokens
    del llm
    plain = LLM("tiny", max_model_len=64, kv_cache_memory_bytes=8 << 20, generation_config="vllm",
                override_generation_config={"temperature": 0.5})
    assert plain.get_default_sampling_params().temperature == 0.5
    assert plain.get_default_sampling_params().top_p == 1.0
    del plain
    from engine.generation_config import resolve_generation_defaults

    assert resolve_generation_defaults("vllm", str(folder), None) == {}
    assert resolve_generation_defaults("auto", str(folder), {"max_new_tokens": 3}) == {
        "temperature": 0.3, "top_p": 0.9, "max_tokens": 3}


def test_generation_config_errors_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvflow import LLM

    with pytest.raises(ValueError, match="generation_config.json"):
        LLM("tiny", generation_config=str(tmp_path))
    with pytest.raises(ValueError, match="do_sample"):
        LLM("tiny", override_generation_config={"do_sample": True})
    with pytest.raises(SystemExit) as exited:  # argparse's usage error, with our reason
        main(["generate", "hi", "--model", "tiny", "--override-generation-config", "{bad"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--override-generation-config must be a JSON object" in err and "Traceback" not in err
    parser = build_parser()
    args = parser.parse_args(["serve", "--override-generation-config", '{"temperature": 0.2, "max_new_tokens": 9}'])
    from engine.config import EngineArgs
    from kvflow.launcher import engine_argv

    forwarded = engine_argv(EngineArgs.from_cli_args(args))  # what serve hands its workers
    assert forwarded[forwarded.index("--override-generation-config") + 1] == \
        '{"temperature": 0.2, "max_new_tokens": 9}'
