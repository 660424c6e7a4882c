"""Speculative decoding on CPU: SmolLM2 (fp32) at batch 1, speculation off vs n-gram prompt lookup vs a
layer-truncated SmolLM2 draft, on an input-grounded set (summarize / edit a given text or code) and an
open-ended chat set.

Each prompt runs off, n-gram and draft back to back (interleaved, so a contended machine's load drifts hit all
three alike); greedy, so the outputs must be identical (checked). Per set: tok/s of each (output tokens / wall
time of the generate calls), speedup over off, and vLLM's mean acceptance length (1 + accepted / drafts).
Writes bench/results/spec_cpu_smollm2.json after every prompt (a stopped run keeps what it measured).

    python -m bench.spec_cpu                      # all prompts, 96 tokens each
    python -m bench.spec_cpu --num-prompts 3 --max-tokens 48
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from bench.harness.records import RESULTS, cpu_name, write_json
from bench.harness.runs import spec_counters
from kvflow import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# A real self-speculative draft: the first 12 of SmolLM2's 30 layers, the same weights, norm and lm_head.
DRAFT = {"model": "smollm2", "num_speculative_tokens": 3, "draft_num_layers": 12}

_TEXT = ("The city council met on Tuesday to discuss the new bike lanes on Main Street. Supporters said the lanes "
         "would make cycling safer and reduce traffic. Shop owners worried that removing parking spaces would hurt "
         "their business. After two hours of debate, the council voted five to two to build the lanes next spring, "
         "and promised to add a parking garage near the market.")
_CODE = ("def average(numbers):\n    total = 0\n    for n in numbers:\n        total = total + n\n"
         "    return total / len(numbers)\n\n\ndef maximum(numbers):\n    best = numbers[0]\n"
         "    for n in numbers:\n        if n > best:\n            best = n\n    return best\n")
_EMAIL = ("Hi team, the release is moved from Friday to Monday because the tests on the payment service are still "
          "failing. Please finish your reviews by Thursday evening. Thanks, Anna")
_CSV = "name,age,city\nAlice,34,Paris\nBob,28,London\nCarla,45,Madrid\nDaniel,39,Berlin\n"
SETS = {
    "input_grounded": [
        f"Add type hints to every function in this Python code. Return the whole code.\n\n{_CODE}",
        f"Rename the variable `total` to `running_sum` in this code and return the full code.\n\n{_CODE}",
        f"Summarize this news text in two sentences.\n\n{_TEXT}",
        f"Fix the spelling and return the corrected text: {_TEXT.replace('council', 'councel')}",
        f"Rewrite this email in a more formal tone, keeping every detail.\n\n{_EMAIL}",
        f"Convert this CSV to a Markdown table.\n\n{_CSV}",
        f"Add a docstring to each function in this code and return the code.\n\n{_CODE}",
        f"Copy this text and put each sentence on its own line.\n\n{_TEXT}",
    ],
    "open_chat": [
        "Write a short poem about the sea.", "What are three good habits for staying healthy?",
        "Tell me a fun fact about space.", "How do I make a cup of tea?", "Give me some ideas for a birthday party.",
        "Why is the sky blue?", "What should I pack for a weekend hiking trip?", "Explain what a computer virus is.",
    ],
}


def chat_ids(llm: LLM, prompt: str, params: SamplingParams) -> tuple[list[int], float]:
    start = time.perf_counter()
    out = llm.chat([{"role": "user", "content": prompt}], params)[0]
    return list(out.outputs[0].token_ids), time.perf_counter() - start


def acceptance(before: tuple[int, int, int], llm: LLM) -> dict[str, Any]:
    drafts, drafted, accepted = (now - then for now, then in zip(spec_counters(llm.stats), before, strict=True))
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_length": round(1 + accepted / drafts, 3) if drafts else None,
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None}


class SetRun:
    """One prompt set's running totals per config, and the record they make so far."""

    def __init__(self, configs: dict[str, LLM]) -> None:
        self.configs = configs
        self.tokens = dict.fromkeys(configs, 0)
        self.seconds = dict.fromkeys(configs, 0.0)
        self.before = {name: spec_counters(llm.stats) for name, llm in configs.items()}
        self.identical = {name: True for name in configs if name != "off"}

    def prompt(self, label: str, prompt: str, params: SamplingParams) -> None:
        reference = None
        for name, llm in self.configs.items():  # interleaved: off, n-gram, draft for each prompt
            ids, elapsed = chat_ids(llm, prompt, params)
            self.tokens[name] += len(ids)
            self.seconds[name] += elapsed
            if name == "off":
                reference = ids
            elif ids != reference:
                self.identical[name] = False
            print(f"{label} {name}: {len(ids)} tokens in {elapsed:.2f}s ({len(ids) / elapsed:.1f} tok/s)", flush=True)

    def record(self, num_prompts: int) -> dict[str, Any]:
        out: dict[str, Any] = {"num_prompts": num_prompts, "load_average": os.getloadavg()[0]}
        for name in self.configs:
            out[f"{name}_tok_s"] = round(self.tokens[name] / self.seconds[name], 3)
            out[f"{name}_output_tokens"] = self.tokens[name]
            out[f"{name}_seconds"] = round(self.seconds[name], 2)
        for name in self.identical:
            out[f"{name}_speedup"] = round(out[f"{name}_tok_s"] / out["off_tok_s"], 3)
            out[f"{name}_greedy_identical"] = self.identical[name]
            out[f"{name}_acceptance"] = acceptance(self.before[name], self.configs[name])
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=8, help="prompts per set (at most 8)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--no-draft", action="store_true", help="skip the layer-truncated draft")
    parser.add_argument("--out", type=Path, default=RESULTS / "spec_cpu_smollm2.json")
    args = parser.parse_args()
    engine = {"max_model_len": 2048, "kv_cache_memory_bytes": 256 << 20, "device": "cpu", "seed": 0}
    specs = {"off": None, "ngram": NGRAM, **({} if args.no_draft else {"draft": DRAFT})}
    configs = {name: LLM("smollm2", speculative_config=spec, **engine) for name, spec in specs.items()}
    for llm in configs.values():  # warm-up (allocator, packed weights)
        chat_ids(llm, "Hello", SamplingParams(temperature=0.0, max_tokens=4))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    sets: dict[str, Any] = {}
    record = {
        "workload": f"SmolLM2-135M-Instruct fp32, CPU, batch 1, chat template, greedy, max_tokens={args.max_tokens}; "
                    "speculation off vs n-gram vs layer-truncated draft, interleaved per prompt",
        "device": f"cpu: {cpu_name()}, {torch.get_num_threads()} torch threads",
        "ngram_config": NGRAM, "draft_config": None if args.no_draft else DRAFT, "sets": sets}
    for set_name, prompts in SETS.items():
        run = SetRun(configs)
        for i, prompt in enumerate(prompts[: args.num_prompts]):
            run.prompt(f"{set_name} #{i}", prompt, params)
            sets[set_name] = run.record(i + 1)
            record["complete"] = set_name == "open_chat" and i + 1 == len(prompts[: args.num_prompts])
            write_json(args.out, record)
        print(json.dumps({set_name: sets[set_name]}, indent=1), flush=True)


if __name__ == "__main__":
    main()
