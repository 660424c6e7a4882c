"""`python -m bench.tp_pd_x4 --smoke` on CPU (tiny model, gloo links), TP2 -> TP2 and TP2 -> 2 x TP1: greedy ids
through P/D equal the decode worker's local prefill, and the transfer records name their layout, every decode worker
and the KV bytes of every decode rank's heads. Not speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.tp_pd_x4 import LAYOUTS

REPO = Path(__file__).resolve().parents[2]
FIELDS = {"workload", "device", "layout", "prompt_tokens", "transfer_gbps", "ttft_disagg_s", "ttft_local_s", "driver"}
TINY_BYTES_PER_TOKEN = 2 * 2 * 2 * 16 * 4  # K and V x 2 layers x 2 KV heads x 16 dims x fp32: every head, once
TP_LAYOUTS = ["tp2_to_tp2", "tp2_to_2x_tp1"]  # tp1_to_tp1, the GPU run's reference, is the P/D tests' own


def test_smoke_checks_and_times_both_tensor_parallel_layouts(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.tp_pd_x4", "--smoke", "--out", str(tmp_path),
                           "--prompt-lens", "64",
                           "--layouts", *TP_LAYOUTS], cwd=REPO, capture_output=True, text=True, timeout=300)
    tail = done.stdout[-3000:] + done.stderr[-3000:]
    check = json.loads((tmp_path / "tp_pd_x4_check.json").read_text())
    assert [c["layout"] for c in check["cases"]] == TP_LAYOUTS, tail
    for case in check["cases"]:
        layout = LAYOUTS[case["layout"]]
        assert case["pass"], (case.get("error"), [r for r in case.get("checks", []) if not r["equal"]], tail)
        assert {r["decode_worker"] for r in case["checks"]} == set(range(layout.decode_workers))
    records = json.loads((tmp_path / "tp_pd_x4_transfer.json").read_text())
    assert [r["layout"] for r in records] == TP_LAYOUTS
    for r in records:
        layout = LAYOUTS[r["layout"]]
        assert r.keys() >= FIELDS and r["all_disaggregated"], r["layout"]
        assert r["kv_bytes"] == 64 * TINY_BYTES_PER_TOKEN
        assert (r["prefill_tensor_parallel_size"], r["decode_tensor_parallel_size"]) == (layout.prefill_tp,
                                                                                        layout.decode_tp)
        assert {run["decode_worker"] for run in r["runs"]["disaggregated"]} == set(range(layout.decode_workers))
    assert done.returncode == 0, tail
