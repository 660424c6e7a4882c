"""vLLM's command-line spellings on every kvflow sub-command, and the refusal of vLLM flags kvflow lacks.

- `--tensor_parallel_size 1` is `--tensor-parallel-size 1`: underscores in a flag's name are dashes (vLLM's
  FlexibleArgumentParser does the same, `--flag_name=value` included).
- A boolean flag takes an optional value, as vLLM's: `--enforce-eager`, `--enforce-eager True`,
  `--enable-chunked-prefill false`, `--enable-prefix-caching=0` (true/false/1/0/yes/no, any case); `--no-<flag>`
  works for every boolean flag. Only those words are taken as the value, so `generate --chat "a prompt"` still
  reads the prompt.
- A vLLM flag the sub-command does not define and `unsupported_flags` lists is refused with one line, "`--X` is
  not supported by kvflow (reason)", exit code 2, before anything starts. The parser's own flags are looked up
  first, so a flag that a later change defines is simply accepted.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from kvflow.commands.unsupported_flags import reason_for, refusal_line

_BOOL_WORDS = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}


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
    i = index + 1
    while i < end:
        token = tokens[i]
        i += 1
        if not token.startswith("-") or len(token) < 2 or token[1].isdigit():  # a value (negative numbers too)
            out.append(token)
            continue
        name, eq, value = token.partition("=")
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
    return out + tokens[end:]
