"""HF transformers' static-batch `generate` on the issue's CPU workload: the peer figure, measured on this box.

The issue quotes HF at 129 out tok/s on its reference machine; the dev VM's host CPU changes between sessions, so
the peer is rerun beside kvflow (same model weights, the same random prompts, fp32, sampling at temperature 1,
every sequence forced to the full output length) and the ratio is what carries across machines.

    .venv/bin/python bench/cpu_hf_generate.py --num-prompts 64 --input-len 128 --output-len 128 [--batch-size 64]
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--output-json")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    from engine.models.loader import resolve_model
    from kvflow.benchmarks.throughput import host_context, random_prompts

    resolved = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(resolved.path, dtype=torch.float32).eval()
    prompts = random_prompts(args.num_prompts, args.input_len, model.config.vocab_size, seed=0)
    ids = torch.tensor([p["prompt_token_ids"] for p in prompts])
    torch.manual_seed(0)
    started = time.perf_counter()
    generated = 0
    with torch.inference_mode():
        for start in range(0, len(ids), args.batch_size):
            batch = ids[start : start + args.batch_size]
            out = model.generate(batch, attention_mask=torch.ones_like(batch), do_sample=True, temperature=1.0,
                                 top_k=0, top_p=1.0, max_new_tokens=args.output_len,
                                 min_new_tokens=args.output_len, pad_token_id=0)
            generated += (out.shape[1] - batch.shape[1]) * batch.shape[0]
    elapsed = time.perf_counter() - started
    record = {"peer": "hf_transformers_generate", "batch_size": args.batch_size, "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len, "elapsed_s": round(elapsed, 3),
              "output_tok_s": round(generated / elapsed, 2), **host_context()}
    print(json.dumps(record))
    if args.output_json:
        with open(args.output_json, "w") as handle:
            json.dump(record, handle)


if __name__ == "__main__":
    main()
