"""vLLM's command-line spellings on every kvflow sub-command, and the refusal of vLLM flags kvflow lacks.

- `--tensor_parallel_size 1` is `--tensor-parallel-size 1`: underscores in a flag's name are dashes (vLLM's
  FlexibleArgumentParser does the same, `--flag_name=value` included).
- A boolean flag takes an optional value, as vLLM's: `--enforce-eager`, `--enforce-eager True`,
  `--enable-chunked-prefill false`, `--enable-prefix-caching=0` (true/false/1/0/yes/no, any case); `--no-<flag>`
  works for every boolean flag. Only those words are taken as the value, so `generate --chat "a prompt"` still
  reads the prompt.
- A JSON-valued flag takes its keys one by one, as vLLM's: `--structured-outputs-config.backend xgrammar`,
  `--speculative-config.num_speculative_tokens=4` (nested keys with more dots); values are read as JSON where they
  parse (true, 4, "x", {...}) and kept as strings otherwise, and merged over the flag's own JSON if it is given too.
- A vLLM flag the sub-command does not define and `unsupported_flags` lists is refused with one line, "`--X` is
  not supported by kvflow (reason)", exit code 2, before anything starts. The parser's own flags are looked up
  first, so a flag that a later change defines is simply accepted.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any

from engine.errors import json_object_argument
from kvflow.commands.unsupported_flags import reason_for, refusal_line

_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
JSON_FLAGS = ("--structured-outputs-config", "--speculative-config", "--override-generation-config")


class FlagRefused(Exception):
    """A vLLM flag kvflow does not support; str() is the one line to print."""


def _bool_flag(action: argparse.Action) -> bool:
    return isinstance(action, argparse.BooleanOptionalAction) or (
        isinstance(action, argparse._StoreConstAction) and isinstance(action.const, bool) and action.nargs == 0)


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def make_vllm_style(parser: argparse.ArgumentParser) -> None:
    """Give every store_true / store_false flag of the sub-commands a hidden `--no-<flag>` (the opposite), so that
    `--flag false` can be spelled with it (BooleanOptionalAction flags have one already)."""
    for sub in _subparsers(parser).values():
        make_vllm_style(sub)  # nested sub-commands (bench throughput, bench serve)
        for action in list(sub._actions):
            if not isinstance(action, argparse._StoreConstAction) or not _bool_flag(action):
                continue
            for option in action.option_strings:
                negated = "--no-" + option[2:]
                if option.startswith("--") and negated not in sub._option_string_actions:
                    sub.add_argument(negated, dest=action.dest, action="store_const", const=not action.const,
                                     help=argparse.SUPPRESS)


def _positive(sub: argparse.ArgumentParser, name: str) -> tuple[str, bool] | None:
    """(the flag's positive spelling, whether `name` is its negation) for a boolean flag; None otherwise."""
    action = sub._option_string_actions.get(name)
    if action is None or not _bool_flag(action):
        return None
    if name.startswith("--no-") and "--" + name[5:] in sub._option_string_actions:
        return "--" + name[5:], True
    return name, False


def _dashes(token: str) -> str:
    """`--flag_name[=value]` -> `--flag-name[=value]`."""
    if not token.startswith("--") or token == "--":
        return token
    name, eq, value = token.partition("=")
    return name.replace("_", "-") + eq + value


def _command(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.ArgumentParser, int] | None:
    """The innermost sub-command's parser and the index of its name in argv (None: no sub-command)."""
    found = None
    current, start = parser, 0
    while True:
        commands = _subparsers(current)
        index = next((i for i in range(start, len(argv)) if argv[i] in commands), None)
        if index is None:
            return found
        current, start = commands[argv[index]], index + 1
        found = (current, index)


def prepare_argv(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """argv with vLLM's spellings normalized; raises FlagRefused for a vLLM flag kvflow does not support."""
    tokens = list(argv)
    end = tokens.index("--") if "--" in tokens else len(tokens)  # after it, everything is positional
    tokens[:end] = [_dashes(t) for t in tokens[:end]]
    command = _command(parser, tokens[:end])
    if command is None:
        return tokens
    sub, index = command
    out = tokens[: index + 1]
    dotted: dict[str, dict[str, Any]] = {}
    i = index + 1
    while i < end:
        token = tokens[i]
        i += 1
        if not token.startswith("-") or len(token) < 2 or token[1].isdigit():  # a value (negative numbers too)
            out.append(token)
            continue
        name, eq, value = token.partition("=")
        base, dot, key = name.partition(".")
        if dot and base in JSON_FLAGS:  # `--json-flag.key value`
            if not eq:
                if i >= end:
                    raise FlagRefused(f"{name} needs a value")
                value = tokens[i]
                i += 1
            if base not in sub._option_string_actions:
                raise FlagRefused(refusal_line(name, reason_for(base) or "this command has no such configuration"))
            _set_key(dotted.setdefault(base, {}), key, value)
            continue
        flag = _positive(sub, name)
        if flag is not None:  # `--flag [true|false]`, `--flag=false`, `--no-flag`
            word = value if eq else (tokens[i] if i < end and tokens[i].lower() in _BOOL_WORDS else None)
            if word is not None and not eq:
                i += 1
            on = _BOOL_WORDS.get(word.lower()) if word is not None else True
            if on is None:
                raise FlagRefused(f"{name} takes true/false/1/0, got {word!r}")
            positive, negated = flag
            out.append(positive if on != negated else "--no-" + positive[2:])
            continue
        if name not in sub._option_string_actions:
            reason = reason_for(name) or (reason_for("-O") if name.startswith("-O") and not name.startswith("--")
                                          else None)
            if reason is not None:
                raise FlagRefused(refusal_line(name, reason))
        out.append(token)
    for base, keys in dotted.items():
        out = _merge_json_flag(out, base, keys)
    return out + tokens[end:]


def _set_key(config: dict[str, Any], dotted_key: str, raw: str) -> None:
    """config[a][b] = raw read as JSON (a string if it is not JSON) for the key `a.b`; dashes in keys are
    underscores (the flag's name had its underscores turned into dashes)."""
    *parents, leaf = [part.replace("-", "_") for part in dotted_key.split(".")]
    for part in parents:
        config = config.setdefault(part, {})
        if not isinstance(config, dict):
            raise FlagRefused(f"dotted key {dotted_key!r}: {part!r} is both a value and a group of keys")
    try:
        config[leaf] = json.loads(raw)
    except json.JSONDecodeError:
        config[leaf] = raw


def _merge(into: dict[str, Any], keys: dict[str, Any]) -> dict[str, Any]:
    for key, value in keys.items():
        into[key] = _merge(into[key], value) if isinstance(value, dict) and isinstance(into.get(key), dict) else value
    return into


def _merge_json_flag(out: list[str], base: str, keys: dict[str, Any]) -> list[str]:
    """out with `base JSON` holding `keys` merged over the JSON `base` was given (the last one), if any."""
    given: dict[str, Any] = {}
    kept: list[str] = []
    j = 0
    while j < len(out):
        name, eq, value = out[j].partition("=")
        if name == base:
            raw = value if eq else (out[j + 1] if j + 1 < len(out) else "{}")
            j += 1 if eq else 2
            try:
                given = json_object_argument(raw, base)
            except ValueError as exc:
                raise FlagRefused(str(exc)) from None
            continue
        kept.append(out[j])
        j += 1
    return [*kept, base, json.dumps(_merge(given, keys))]
