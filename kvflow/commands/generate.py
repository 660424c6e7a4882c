"""`kvflow generate --model smollm2 [--chat] "prompt"`: print one completion."""

from __future__ import annotations

import argparse

from engine.arg_utils import EngineArgs
from engine.sampling_params import SamplingParams


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("generate", help="generate a completion for one prompt")
    parser.add_argument("prompt", help="the prompt text (the user message with --chat)")
    parser.add_argument("--chat", action="store_true", help="apply the model's chat template")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens "
                                                                  "whose probabilities sum to this")
    parser.add_argument("--top-k", type=int, default=-1, help="sample among the k likeliest tokens (-1: all)")
    parser.add_argument("--sampling-seed", type=int, default=None,
                        help="seed of this request's sampling (default: the engine's --seed stream)")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from kvflow.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.sampling_seed)
    with llm:  # stops the other tensor-parallel ranks, if any
        if args.chat:
            output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            output = llm.generate(args.prompt, params)[0]
    print(output.outputs[0].text)
    return 0
