#!/usr/bin/env bash
# The issue's CPU workload, repeated: the dev box is a shared 2-core VM whose speed drifts by ~10%, so one run is
# not a result, and its host CPU changes between sessions. HF transformers' static-batch generate runs on the same
# workload in the same sitting (bench/cpu_hf_generate.py), so the peer ratio is measured, not quoted.
# Writes every run, the median and the peer to bench/results/cpu_throughput_smollm2.json.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${RUNS:-3}
tmp=$(mktemp -d)
for i in $(seq 1 "$RUNS"); do
  .venv/bin/kvflow --log-level WARNING bench throughput --model smollm2 --dtype float32 --num-prompts 64 \
    --input-len 128 --output-len 128 --ignore-eos --output-json "$tmp/run$i.json" | head -1
done
.venv/bin/python bench/cpu_hf_generate.py --output-json "$tmp/hf.json" 2>/dev/null | tail -1
.venv/bin/python - "$tmp" <<'PY'
import json, pathlib, statistics, sys
runs = [json.loads(p.read_text()) for p in sorted(pathlib.Path(sys.argv[1]).glob("run*.json"))]
hf = json.loads((pathlib.Path(sys.argv[1]) / "hf.json").read_text())
median = statistics.median(r["output_tok_s"] for r in runs)
out = {"command": "kvflow bench throughput --model smollm2 --dtype float32 --num-prompts 64 --input-len 128 "
                  "--output-len 128 --ignore-eos",
       "median_output_tok_s": median,
       "best_output_tok_s": max(r["output_tok_s"] for r in runs),
       "cpu_model": runs[0]["cpu_model"],
       "hf_generate_same_box": hf, "ratio_vs_hf_same_box": round(median / hf["output_tok_s"], 2),
       "issue_reference_peers": {"vllm_cpu_0.32_output_tok_s": 112, "hf_generate_output_tok_s": 129},
       "goal_output_tok_s": 225, "runs": runs}
path = pathlib.Path("bench/results/cpu_throughput_smollm2.json")
path.write_text(json.dumps(out, indent=2) + "\n")
print(f"median {median} best {out['best_output_tok_s']} output tok/s, HF generate {hf['output_tok_s']} "
      f"({out['ratio_vs_hf_same_box']}x) on {out['cpu_model']} -> {path}")
PY
