#!/usr/bin/env python3
"""The cost of structured output on a GPU: decode throughput of one batch with 1 in 8 requests constrained by a
JSON schema (xgrammar bitmasks in the batched sampler) against the same batch unconstrained. The issue's goal:
<= 10 % throughput cost. Llama-3.1-8B shapes with random weights (bf16), in-process `LLMEngine`.

The random-weight preset has no tokenizer, so grammars are compiled against a synthetic 128256-token vocabulary
(every printable ASCII character, then random 2-8 character pieces: the masks' structure is a BPE vocabulary's,
their content is arbitrary). Every request generates exactly `--output-len` tokens (ignore_eos): a constrained
request whose JSON completes keeps emitting end-of-sequence, so both runs produce the same token count.

Checks (PASS/FAIL lines, in the JSON too): every constrained output is accepted token by token by a fresh matcher
of its grammar (the GPU bitmask path masked what the grammar forbids); unconstrained rows of the mixed batch equal
the same rows of the unconstrained batch (greedy: masking one row leaves the others alone).

Timing: greedy and sampled (temperature 1, top_p 0.95), each `--reps` times alternating the two variants after a
warm-up; the median throughput per variant; cost = 1 - constrained / unconstrained.

    python3 bench/structured_gpu.py                 # H100: writes bench/results/structured_gpu_<device>.json
    python3 bench/structured_gpu.py --smoke         # CPU, tiny preset: the same code paths at tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import string
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine.arg_utils import EngineArgs  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from engine.structured.grammar import StructuredOutputManager, StructuredOutputsParams  # noqa: E402

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"street": {"type": "string"}, "city": {"type": "string"}},
                "required": ["street", "city"]}}, "required": ["name", "age", "tags", "address"]}
CONSTRAINED_EVERY = 8  # 1 in 8 requests


def synthetic_tokenizer_info(vocab_size: int, eos: int) -> Any:
    import xgrammar as xgr

    rng = random.Random(0)
    pieces = list(string.printable[:95])  # every printable ASCII character: JSON can always be spelled
    alphabet = string.ascii_letters + string.digits + ' "{}[],:.-_'
    seen = set(pieces)
    while len(pieces) < vocab_size:
        piece = "".join(rng.choice(alphabet) for _ in range(rng.randint(2, 8)))
        if piece not in seen:
            seen.add(piece)
            pieces.append(piece)
    pieces[eos] = "</s>"
    return xgr.TokenizerInfo(pieces, vocab_type=xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[eos])


def build_engine(args: argparse.Namespace) -> LLMEngine:
    engine_args = EngineArgs(model=args.model, load_format="dummy", dtype=args.dtype, max_model_len=args.max_model_len,
                             max_num_seqs=args.batch, kv_cache_memory_bytes=args.kv_bytes, seed=0)
    engine = LLMEngine(engine_args.create_engine_config())
    vocab = engine.config.model.arch.vocab_size
    eos = engine.eos_token_id if engine.eos_token_id is not None else vocab - 1
    manager = StructuredOutputManager(None, vocab, eos, tokenizer_info=synthetic_tokenizer_info(vocab, eos))
    engine.structured.grammar = manager  # the engine compiles (validation), its runner builds matchers
    engine.runner.structured_output = manager
    return engine


def run_batch(engine: LLMEngine, prompts: list[list[int]], output_len: int, constrained: bool, greedy: bool,
              tag: str) -> tuple[float, dict[str, list[int]], list[str]]:
    """Seconds for the whole batch (prefill + decode), outputs by request id, the constrained ids."""
    guided = StructuredOutputsParams(json=SCHEMA)
    ids, constrained_ids = [], []
    for i, prompt in enumerate(prompts):
        is_constrained = constrained and i % CONSTRAINED_EVERY == 0
        params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0 if greedy else 1.0,
                                top_p=1.0 if greedy else 0.95, seed=None if greedy else i,
                                structured_outputs=guided if is_constrained else None)
        rid = f"{tag}-{i}"
        engine.add_request(rid, {"prompt_token_ids": prompt}, params, output_kind="final")
        ids.append(rid)
        if is_constrained:
            constrained_ids.append(rid)
    outputs: dict[str, list[int]] = {}
    sync()
    started = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
    sync()
    return time.perf_counter() - started, outputs, constrained_ids


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def grammar_accepts(engine: LLMEngine, tokens: list[int]) -> tuple[bool, int]:
    """A fresh matcher accepts the whole output (the JSON part, then end-of-sequence repeats); also how many
    tokens the JSON took (until the grammar terminated)."""
    import xgrammar as xgr

    manager = engine.structured.grammar
    matcher = xgr.GrammarMatcher(manager.compile(StructuredOutputsParams(json=SCHEMA)))
    for n, token in enumerate(tokens):
        if matcher.is_terminated():
            return all(t == manager.eos_token_id for t in tokens[n:]), n
        if not matcher.accept_token(token):
            return False, n
    return True, len(tokens)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny preset on CPU, tiny shapes: the code paths only")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--output-json", type=Path, default=None)
    args = parser.parse_args()
    if args.smoke:
        args.model, args.dtype, args.batch, args.input_len, args.output_len, args.reps = "tiny", "float32", 16, 16, \
            24, 1
        args.max_model_len, args.kv_bytes = 256, 32 << 20
    else:
        args.model, args.dtype, args.max_model_len, args.kv_bytes = "llama-3.1-8b", "bfloat16", 2048, 16 << 30
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    engine = build_engine(args)
    vocab = engine.config.model.arch.vocab_size
    rng = random.Random(1)
    margin = min(1000, vocab // 4)  # clear of special tokens at either end
    prompts = [[rng.randrange(margin, vocab - margin) for _ in range(args.input_len)] for _ in range(args.batch)]
    checks: list[dict[str, Any]] = []
    timings: dict[str, dict[str, list[float]]] = {}
    tokens_per_run = args.batch * args.output_len
    json_lengths: list[int] = []
    step = 0
    plain: dict[str, list[int]] = {}
    mixed: dict[str, list[int]] = {}
    for greedy in (True, False):
        mode = "greedy" if greedy else "sampled"
        run_batch(engine, prompts, min(args.output_len, 16), True, greedy, f"warm-{mode}")  # compile, graphs
        timings[mode] = {"none": [], "one_in_8": []}
        for rep in range(args.reps):
            for constrained in (False, True):
                step += 1
                seconds, outputs, constrained_ids = run_batch(engine, prompts, args.output_len, constrained, greedy,
                                                              f"{mode}-{rep}-{int(constrained)}-{step}")
                timings[mode]["one_in_8" if constrained else "none"].append(tokens_per_run / seconds)
                if rep == 0 and constrained:
                    results = [grammar_accepts(engine, outputs[rid]) for rid in constrained_ids]
                    json_lengths += [n for _, n in results]
                    checks.append({"name": f"{mode}: constrained outputs follow the grammar",
                                   "ok": all(ok for ok, _ in results), "requests": len(results)})
                if rep == 0 and greedy:
                    if constrained:
                        mixed = outputs
                    else:
                        plain = outputs
        if greedy:
            unconstrained = [i for i in range(args.batch) if i % CONSTRAINED_EVERY != 0]
            plain_by_index = {int(k.rsplit("-", 1)[1]): v for k, v in plain.items()}
            mixed_by_index = {int(k.rsplit("-", 1)[1]): v for k, v in mixed.items()}
            checks.append({"name": "greedy: unconstrained rows are unchanged by the constrained ones",
                           "ok": all(plain_by_index[i] == mixed_by_index[i] for i in unconstrained),
                           "requests": len(unconstrained)})
    summary: dict[str, Any] = {}
    for mode, runs in timings.items():
        none, mixed_tp = statistics.median(runs["none"]), statistics.median(runs["one_in_8"])
        summary[mode] = {"tokens_per_s_none": round(none, 1), "tokens_per_s_one_in_8": round(mixed_tp, 1),
                         "cost_fraction": round(1 - mixed_tp / none, 4), "runs": runs}
    for check in checks:
        print(f"{'PASS' if check['ok'] else 'FAIL'} {check['name']} ({check['requests']} requests)", flush=True)
    for mode, row in summary.items():
        print(f"{mode}: {row['tokens_per_s_none']} tok/s unconstrained, {row['tokens_per_s_one_in_8']} tok/s with 1 in "
              f"8 constrained: cost {100 * row['cost_fraction']:.1f} % (goal <= 10 %)", flush=True)
    record = {
        "workload": {"model": f"{args.model} shapes, random weights ({args.dtype})", "batch": args.batch,
                     "input_len": args.input_len, "output_len": args.output_len, "constrained": "1 in 8",
                     "schema": SCHEMA, "vocabulary": "synthetic (see the script)", "reps": args.reps,
                     "smoke": args.smoke},
        "device": device, "torch": torch.__version__, "checks": checks, "throughput": summary,
        "constrained_json_tokens": {"min": min(json_lengths, default=0), "max": max(json_lengths, default=0),
                                    "median": statistics.median(json_lengths) if json_lengths else 0},
        "goal_met": all(row["cost_fraction"] <= 0.10 for row in summary.values()),
    }
    out = args.output_json
    if out is None:
        name = "smoke_cpu" if args.smoke else device.lower().replace(" ", "_")
        out = ROOT / "bench" / "results" / f"structured_gpu_{name}.json"
    outdir = os.environ.get("OUT")
    for path in [out, *([Path(outdir) / out.name] if outdir else [])]:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {path}", flush=True)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
