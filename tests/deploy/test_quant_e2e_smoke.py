"""`python -m bench.quant_gpu --smoke --parts e2e` on CPU (tiny Llama, one quantized mode): every (mode, batch)
record carries exactly the issue's fields beside bf16 of the same run, a record of another call's (mode, batch)
stays in the file, and the greedy checks pass in fp32 and bf16: int4 against the dense checkpoint of its weights,
the dummy GGUF against HF transformers on its dequantized weights. Not speed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIELDS = {"workload", "device", "mode", "batch", "out_tok_s", "first_batch_out_tok_s", "ratio_vs_bf16"}


def test_smoke_records_each_mode_beside_bf16_and_checks_int4_and_gguf(tmp_path: Path) -> None:
    out = tmp_path / "quant_e2e_smoke.json"
    earlier = {"workload": "an earlier call", "device": "cpu", "mode": "fp8", "batch": "tput", "out_tok_s": 1.0,
               "first_batch_out_tok_s": 1.0, "ratio_vs_bf16": 1.0}
    out.write_text(json.dumps({"records": [earlier], "runs": []}))
    done = subprocess.run([sys.executable, "-m", "bench.quant_gpu", "--smoke", "--parts", "e2e", "--modes",
                           "int4_fp8kv", "gguf", "--batches", "1", "--e2e-out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    tail = done.stdout[-3000:] + done.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["records"][0] == earlier, tail
    records = doc["records"][1:]
    assert [(r["mode"], r["batch"]) for r in records] == [("bf16", 1), ("int4_fp8kv", 1), ("gguf", 1)], tail
    for r in records:
        assert r.keys() == FIELDS and r["out_tok_s"] > 0 and r["first_batch_out_tok_s"] > 0, r
        assert r["ratio_vs_bf16"] == (1.0 if r["mode"] == "bf16" else r["ratio_vs_bf16"]) > 0
    assert doc["runs"][-1]["errors"] == [], tail
    for dtype in ("float32", "bfloat16"):
        assert doc["check"][dtype]["verdict"] == "PASS", (doc["check"], tail)
        assert doc["gguf_check"][dtype]["verdict"] == "PASS", (doc["gguf_check"], tail)
        assert doc["gguf_check"][dtype]["oracle"] == "HF transformers fp32"
    assert done.returncode == 0, tail
