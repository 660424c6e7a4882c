"""vLLM flag parity, in-process (no worker starts): every flag of `vllm serve` (tests/data/vllm_serve_flags.txt) is
either defined by `kvflow serve` or refused with one line and exit code 2; vLLM's spellings (underscores,
`--flag true/false`) on every sub-command; --generation-config / --override-generation-config, max_new_tokens as a
cap, and LLM.get_default_sampling_params(); --guided-decoding-backend / --structured-outputs-config on every engine
command and LLM(...), their one-line refusals, and the config reaching the engine and the workers' argv."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from kvflow.cli import build_parser, main
from kvflow.commands.flag_compat import FlagRefused, prepare_argv
from kvflow.commands.unsupported_flags import IN_PROGRESS, UNSUPPORTED

FLAGS_FILE = Path(__file__).parents[1] / "data" / "vllm_serve_flags.txt"


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
    for argv in (["serve", "--enable_lora"], ["router", "--guided_decoding_backend", "xgrammar"],
                 ["prefill", "--tool-call-parser=hermes"], ["bench", "serve", "--structured-outputs-config", "{}"],
                 ["generate", "hi", "--no-enable-lora"]):
        assert main(argv) == 2
        assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_flags_other_branches_add_win_over_the_refusal(parser: argparse.ArgumentParser) -> None:
    """A flag the real parser defines is never refused: the table is only the fallback."""
    for merged in ("--tensor-parallel-size", "--kv-cache-dtype", "--cpu-offload-gb"):  # merged since
        assert merged not in IN_PROGRESS
    assert prepare_argv(parser, ["serve", "--tensor_parallel_size", "1", "--cpu_offload_gb", "0"]) == [
        "serve", "--tensor-parallel-size", "1", "--cpu-offload-gb", "0"]
    # The rows left are flags some commands implement: `kvflow serve` defines every one, so none is refused there.
    assert set(IN_PROGRESS) <= set(serve_parser(parser)._option_string_actions)
    assert "--guided-decoding-backend" in IN_PROGRESS  # the router has no engine, so it refuses it
    fresh = build_parser()
    router = next(a for a in fresh._actions if isinstance(a, argparse._SubParsersAction)).choices["router"]
    router.add_argument("--guided-decoding-backend", default="xgrammar")  # as a later change would
    args = fresh.parse_args(prepare_argv(fresh, ["router", "--guided_decoding_backend", "auto"]))
    assert args.guided_decoding_backend == "auto"


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
    from engine.processing.generation_config import resolve_generation_defaults

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
    from engine.arg_utils import EngineArgs
    from kvflow.launcher import engine_argv

    forwarded = engine_argv(EngineArgs.from_cli_args(args))  # what serve hands its workers
    assert forwarded[forwarded.index("--override-generation-config") + 1] == \
        '{"temperature": 0.2, "max_new_tokens": 9}'


# ---- structured output: --guided-decoding-backend / --structured-outputs-config ---------------------------------
ENGINE_COMMANDS = (["serve"], ["prefill", "--port", "1"], ["decode", "--port", "1"], ["generate", "hi"],
                   ["bench", "throughput"], ["bench", "routing"])


@pytest.mark.parametrize("command", ENGINE_COMMANDS, ids=lambda c: " ".join(c[:2]))
def test_structured_output_flags_on_every_engine_command(parser: argparse.ArgumentParser,
                                                         command: list[str]) -> None:
    from engine.arg_utils import EngineArgs
    from engine.structured.config import StructuredOutputsConfig

    def config(*flags: str) -> StructuredOutputsConfig:
        args = parser.parse_args(prepare_argv(parser, [*command, *flags]))
        return EngineArgs.from_cli_args(args).structured_outputs()

    assert config() == StructuredOutputsConfig()
    assert config("--guided_decoding_backend", "xgrammar").backend == "xgrammar"
    assert config("--guided-decoding-backend=auto").backend == "auto"
    assert config("--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true, '
                  '"disable_fallback": true}') == StructuredOutputsConfig("xgrammar", True, True)
    # vLLM's defaults of the keys xgrammar cannot honour ask for nothing, so they pass
    assert config("--structured_outputs_config", '{"disable_additional_properties": false, "reasoning_parser": ""}'
                  ) == StructuredOutputsConfig()
    assert config("--guided-decoding-backend", "xgrammar", "--structured-outputs-config",
                  '{"backend": "xgrammar", "disable_any_whitespace": true}').disable_any_whitespace
    # vLLM's dotted keys, alone or merged over the flag's JSON (the dotted ones win)
    assert config("--structured-outputs-config.backend", "xgrammar",
                  "--structured_outputs_config.disable_any_whitespace=true") == StructuredOutputsConfig(
                      "xgrammar", disable_any_whitespace=True)
    assert config("--structured-outputs-config", '{"backend": "auto", "disable_fallback": true}',
                  "--structured-outputs-config.backend", "xgrammar") == StructuredOutputsConfig(
                      "xgrammar", disable_fallback=True)


def test_dotted_json_flag_keys(parser: argparse.ArgumentParser) -> None:
    argv = prepare_argv(parser, ["generate", "hi", "--speculative-config.method", "ngram",
                                 "--speculative_config.num_speculative_tokens=4", "--max-tokens", "3",
                                 "--override-generation-config.temperature", "0.5"])
    assert argv[:2] == ["generate", "hi"] and "--max-tokens" in argv
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "ngram",
                                                                        "num_speculative_tokens": 4}
    assert json.loads(argv[argv.index("--override-generation-config") + 1]) == {"temperature": 0.5}
    nested = prepare_argv(parser, ["serve", "--speculative-config.draft.model", "x"])
    assert json.loads(nested[-1]) == {"draft": {"model": "x"}}
    with pytest.raises(FlagRefused, match="needs a value"):
        prepare_argv(parser, ["serve", "--structured-outputs-config.backend"])
    with pytest.raises(FlagRefused, match="must be a JSON object"):
        prepare_argv(parser, ["serve", "--structured-outputs-config", "[1]", "--structured-outputs-config.backend",
                              "auto"])
    with pytest.raises(FlagRefused) as caught:  # the router has no engine: refused in one line, as the flag itself
        prepare_argv(parser, ["router", "--structured-outputs-config.backend", "xgrammar"])
    assert str(caught.value).startswith("`--structured-outputs-config.backend` is not supported by kvflow (")


@pytest.mark.parametrize(("flags", "line"), [
    (["--guided-decoding-backend", "guidance"],
     "`--guided-decoding-backend guidance` is not supported by kvflow (structured output uses xgrammar; use auto or "
     "xgrammar)"),
    (["--guided_decoding_backend", "outlines"], "`--guided-decoding-backend outlines` is not supported by kvflow ("),
    (["--guided-decoding-backend", "xgrammar:disable-any-whitespace"],
     "backend options are keys of `--structured-outputs-config`, e.g. '{\"disable_any_whitespace\": true}')"),
    (["--structured-outputs-config", '{"backend": "lm-format-enforcer"}'],
     "`--structured-outputs-config` backend 'lm-format-enforcer' is not supported by kvflow (structured output "
     "uses xgrammar; use auto or xgrammar)"),
    (["--structured-outputs-config", '{"reasoning_parser": "deepseek_r1"}'],
     "`--structured-outputs-config` key 'reasoning_parser' = \"deepseek_r1\" is not supported by kvflow "
     "(reasoning-content parsing is not implemented)"),
    (["--structured-outputs-config", '{"enable_in_reasoning": true}'], "key 'enable_in_reasoning' = true is not"),
    (["--structured-outputs-config", '{"disable_additional_properties": true}'],
     "`--structured-outputs-config` key 'disable_additional_properties' = true is not supported by kvflow (it "
     "applies to vLLM's guidance backend only; xgrammar never generates properties a JSON schema does not "
     "declare)"),
    (["--structured-outputs-config", '{"disable_any_whitespace": "yes"}'],
     "`--structured-outputs-config` key 'disable_any_whitespace' must be true or false, got 'yes'"),
    (["--structured-outputs-config", '{"whitespace_pattern": " "}'],
     "`--structured-outputs-config`: unknown key(s) 'whitespace_pattern' (vLLM's keys: backend, "),
    (["--structured-outputs-config", "xgrammar"], "`--structured-outputs-config` is not valid JSON: "),
    (["--structured-outputs-config", "[1]"], "`--structured-outputs-config` must be a JSON object (a dict), got list"),
    (["--guided-decoding-backend", "auto", "--structured-outputs-config", '{"backend": "xgrammar"}'],
     "`--guided-decoding-backend auto` and `--structured-outputs-config` backend 'xgrammar' disagree; give the "
     "backend once"),
])
@pytest.mark.parametrize("command", [["serve", "--model", "tiny"], ["decode", "--model", "tiny", "--port", "1"],
                                     ["generate", "hi", "--model", "tiny"]], ids=lambda c: c[0])
def test_structured_output_refusals_are_one_line_before_anything_starts(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: list[str], flags: list[str],
        line: str) -> None:
    import engine.models.loader
    import kvflow.launcher

    def must_not_run(*args: object, **kwargs: object) -> None:
        raise AssertionError("reached a worker start or a model load")

    monkeypatch.setattr(kvflow.launcher.WorkerCluster, "start", must_not_run)
    monkeypatch.setattr(engine.models.loader, "resolve_model", must_not_run)
    assert main([*command, *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvflow: error: ") and line in err[0]


def test_structured_output_config_reaches_the_llm_engine_and_the_workers(parser: argparse.ArgumentParser) -> None:
    from engine.arg_utils import EngineArgs
    from engine.structured.config import StructuredOutputsConfig
    from kvflow import LLM
    from kvflow.launcher import engine_argv

    small = {"max_model_len": 64, "kv_cache_memory_bytes": 8 << 20}
    for kwargs in ({"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}},
                   {"structured_outputs_config": StructuredOutputsConfig(disable_any_whitespace=True),
                    "guided_decoding_backend": "xgrammar"}):
        with LLM("tiny", **small, **kwargs) as llm:  # vLLM's LLM(...) engine arguments
            assert llm.llm_engine.config.structured_outputs == StructuredOutputsConfig("xgrammar", False, True)
            assert llm.llm_engine.structured_output.config.disable_any_whitespace  # what compiles the grammars
    for bad, match in (({"guided_decoding_backend": "guidance"}, "`--guided-decoding-backend guidance` is not"),
                       ({"structured_outputs_config": {"backend": "outlines"}}, "backend 'outlines' is not")):
        with pytest.raises(ValueError, match=match):
            LLM("tiny", **small, **bad)
    # `kvflow serve` hands both flags to every worker (prefill workers too), which parse them back to the same
    args = parser.parse_args(["serve", "--guided-decoding-backend", "xgrammar", "--structured-outputs-config",
                              '{"disable_any_whitespace": true}'])
    engine_args = EngineArgs.from_cli_args(args)
    for role, worker_args in (("decode", engine_args), ("prefill", engine_args.without_speculation())):
        forwarded = engine_argv(worker_args)
        assert forwarded[forwarded.index("--structured-outputs-config") + 1] == '{"disable_any_whitespace": true}'
        assert forwarded[forwarded.index("--guided-decoding-backend") + 1] == "xgrammar"
        back = parser.parse_args([role, "--port", "1", *forwarded])
        assert EngineArgs.from_cli_args(back).structured_outputs() == StructuredOutputsConfig("xgrammar", False, True)
    # a config object given in code travels as its JSON
    forwarded = engine_argv(EngineArgs(structured_outputs_config=StructuredOutputsConfig(disable_fallback=True)))
    assert json.loads(forwarded[forwarded.index("--structured-outputs-config") + 1]) == {
        "backend": "auto", "disable_fallback": True, "disable_any_whitespace": False}
    assert "--structured-outputs-config" not in engine_argv(EngineArgs())  # the default is not forwarded
