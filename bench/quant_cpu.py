"""Quantization on CPU with SmolLM2-135M (issue 14): perplexity on a fixed text, resident weight bytes and batch-1
decode tok/s for the default fp32 form (GGUF Q4_1 dequantized: the oracle), native int4 (`quantization="gguf"`),
fp8 KV (`kv_cache_dtype="fp8"`) and both together; decode both after a short prompt and after 1,536 tokens, where
attention reads the cache. Also records each layer's K/V absolute maximum (fp32 run) to show the fp8 KV scale of
1.0 (`kv_scales`: SmolLM2's GGUF calibrates none) never saturates (e4m3 max 448).

    python -m bench.quant_cpu            # writes bench/results/quant_cpu_smollm2.json
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

import torch

from bench.harness.records import RESULTS, cpu_name, write_json
from bench.harness.runs import timed_generate
from engine.quant.quant_layers import module_weight_bytes
from kvflow import LLM, SamplingParams

TEXT = Path(__file__).resolve().parent / "data" / "quant_ppl_text.txt"
CONFIGS = {
    "fp32": {},
    "int4_gguf": {"quantization": "gguf"},
    "fp8_kv": {"kv_cache_dtype": "fp8"},
    "int4_gguf+fp8_kv": {"quantization": "gguf", "kv_cache_dtype": "fp8"},
}
SHORT_PROMPT = [1, 504, 3458, 282, 4649, 314]
LONG_CONTEXT = 1536  # tokens of the bench text (repeated) before decoding: attention reads 1,536+ cached tokens a step
LONG = f"decode_tok_s_batch1_ctx{LONG_CONTEXT}"


def perplexity(llm: LLM, ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of tokens 1..N-1, each given its prefix, in one prefill."""
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    entries = out[0].prompt_logprobs
    nll = [-entries[i][tok].logprob for i, tok in enumerate(ids) if i > 0]
    return math.exp(sum(nll) / len(nll))


def decode_tok_s(llm: LLM, tokens: int, prompt_ids: list[int]) -> float:
    """Batch-1 tokens per second over `tokens` steps after `prompt_ids`. Warmed up before: the prompt is then in
    the prefix cache, so the timed run's prefill is its last partial block only."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    return tokens / timed_generate(llm, [{"prompt_token_ids": prompt_ids}], params)[1]


def static_figures(llm: LLM, ids: list[int]) -> dict[str, Any]:
    runner = llm.llm_engine.runner
    return {"perplexity": round(perplexity(llm, ids), 4), "weight_bytes": module_weight_bytes(runner.model),
            "kv_block_bytes": runner.block_bytes, "kv_scales": sorted(set(runner.kv_scales)) or None}


def decode_rounds(engines: dict[str, LLM], results: dict[str, dict[str, Any]], contexts: dict[str, list[int]],
                  tokens: int, repeats: int) -> None:
    """Each config keeps its best rate; rounds interleave the configs, so load from other processes on a shared
    box falls on all of them."""
    warm = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    for llm in engines.values():
        for prompt_ids in contexts.values():
            llm.generate([{"prompt_token_ids": prompt_ids}], warm)
    for _ in range(repeats):
        for name, llm in engines.items():
            for key, prompt_ids in contexts.items():
                rate = round(decode_tok_s(llm, tokens, prompt_ids), 1)
                results[name][key] = max(results[name].get(key, 0.0), rate)


def add_ratios(results: dict[str, dict[str, Any]]) -> None:
    base = results.get("fp32")
    if base is None:
        return
    for r in results.values():
        r["weight_bytes_vs_fp32"] = round(r["weight_bytes"] / base["weight_bytes"], 4)
        r["perplexity_vs_fp32"] = round(r["perplexity"] / base["perplexity"] - 1, 5)
        r["decode_vs_fp32"] = round(r["decode_tok_s_batch1"] / base["decode_tok_s_batch1"], 3)
        r[f"decode_vs_fp32_ctx{LONG_CONTEXT}"] = round(r[LONG] / base[LONG], 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="decode rounds over all configs; each keeps its best")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--out", type=Path, default=RESULTS / "quant_cpu_smollm2.json")
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    kv_absmax: dict[str, list[float]] = {}
    ids: list[int] = []
    engines: dict[str, LLM] = {}
    for name in args.configs:
        llm = engines[name] = LLM("smollm2", kv_cache_memory_bytes=256 << 20, max_model_len=2048, **CONFIGS[name])
        ids = ids or list(llm.get_tokenizer()(TEXT.read_text()).input_ids)
        results[name] = static_figures(llm, ids)
        if name == "fp32":  # the perplexity prefill wrote the text's K/V; the rest of the cache is zeros
            caches = llm.llm_engine.runner.kv_caches
            kv_absmax = {"k": [float(k.abs().max()) for k, _ in caches], "v": [float(v.abs().max()) for _, v in caches]}
    long_prompt = (ids * (LONG_CONTEXT // len(ids) + 1))[:LONG_CONTEXT]  # the text, repeated
    decode_rounds(engines, results, {"decode_tok_s_batch1": SHORT_PROMPT, LONG: long_prompt}, args.decode_tokens,
                  args.repeats)
    for name in engines:
        print(name, results[name], flush=True)
    engines.clear()
    add_ratios(results)
    write_json(args.out, {
        "workload": f"SmolLM2-135M-Instruct (GGUF Q4_1) on CPU: perplexity of bench/data/quant_ppl_text.txt "
                    f"({len(ids)} tokens, one prefill), weight bytes, batch-1 decode of {args.decode_tokens} tokens "
                    f"after a 6-token prompt and after {LONG_CONTEXT} tokens of the text repeated (best of "
                    f"{args.repeats} rounds interleaving the configs)",
        "device": f"{cpu_name()} CPU, {os.cpu_count()} cores", "torch": torch.__version__,
        "load_average": os.getloadavg(), "results": results, "kv_absmax_per_layer_fp32": kv_absmax,
        "e4m3_max": 448.0})


if __name__ == "__main__":
    main()
