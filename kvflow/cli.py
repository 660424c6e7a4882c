"""The `kvflow` command line: one sub-command per module under kvflow/commands."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys

from engine.errors import ModelNotAvailable
from engine.process.lifeline import die_with_parent_if_asked
from engine.process.openmp import apply_openmp_policy
from kvflow.commands.flag_compat import FlagRefused, make_vllm_style, prepare_argv

# Each module defines register(subparsers) -> None and sets a `handler` default on its parser.
COMMAND_MODULES = [
    "kvflow.commands.generate",
    "kvflow.commands.bench",
    "kvflow.commands.workers",
    "kvflow.commands.router",
    "kvflow.commands.serve",
]


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Each flag's help ends with its default, unless the help names it already or there is none to show (None,
    False, an empty list). A default taken from the environment (a key, a URL with a password) must be named in
    the help text, so that --help never prints it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (not action.option_strings or "default" in text.lower() or action.default is None
                or action.default is False or action.default == [] or action.default is argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)"


def _use_formatter(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = DefaultsHelpFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _use_formatter(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow", description="kvflow: disaggregated LLM serving")
    parser.add_argument("--log-level", default=os.environ.get("KVFLOW_LOG_LEVEL", "INFO"),
                        help="DEBUG, INFO, WARNING or ERROR (default: $KVFLOW_LOG_LEVEL, else INFO)")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    make_vllm_style(parser)
    _use_formatter(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    die_with_parent_if_asked()
    apply_openmp_policy()  # before the commands' modules import torch, which loads libgomp
    parser = build_parser()
    try:  # vLLM's spellings (--flag_name, --flag false); vLLM flags kvflow lacks end here, one line each
        argv = prepare_argv(parser, sys.argv[1:] if argv is None else argv)
    except FlagRefused as exc:
        print(exc, file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, ModelNotAvailable) as exc:  # bad arguments, input or model: a message, not a traceback
        print(f"kvflow: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
