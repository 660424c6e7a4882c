"""`python -m bench.pd_adaptive --smoke` on CPU (tiny model, the KV link over gRPC): every mode starts, every
workload's record carries the issue's fields, no request fails. Not speed: the smoke's loads last seconds."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bench.pd_adaptive import (
    MODE_FLAGS,
    OPT_IN_MODES,
    SLO,
    mode_flags,
    parse_pools,
    plan,
    pool_record,
    replace_record,
)

REPO = Path(__file__).resolve().parents[2]
FIELDS = {"workload", "device", "mode", "ttft_p99_s", "itl_p99_s", "slo_attainment", "slo", "out_tok_s", "failed",
          "pool_moves"}
WORKLOADS = {"mixed", "prefill_heavy", "decode_heavy", "changing", "sweep"}


def test_mode_flags_pin_the_fixed_layouts_to_the_static_policy() -> None:
    assert mode_flags("static_1p1d", SLO, None) == ["--disagg-policy", "static", "--prefill-workers", "1",
                                                     "--decode-workers", "1"]
    assert mode_flags("dp2", SLO, None) == ["--disagg-policy", "static", "--data-parallel-size", "2"]
    adaptive = mode_flags("adaptive", SLO, 30.0)
    assert adaptive[:2] == ["--disagg-policy", "adaptive"]
    assert " ".join(adaptive).endswith("--slo-ttft-ms 1000 --slo-itl-ms 40 --itl-target-ms 30")
    assert " ".join(mode_flags("adaptive_dp2", SLO, None)) == ("--disagg-policy adaptive --data-parallel-size 2 "
                                                               "--slo-ttft-ms 1000 --slo-itl-ms 40")


def test_a_record_replaces_only_its_own_mode_workload_and_rate() -> None:
    """A mode cut short by a device call's limit keeps the file's older record (it once lost two-replica records)."""
    old = [{"workload": "w", "mode": "dp2", "date": "1"}, {"workload": "w", "mode": "adaptive", "date": "1"},
           {"workload": "v", "mode": "adaptive", "date": "1"},
           {"workload": "s", "mode": "adaptive", "request_rate": 12, "date": "1"},
           {"workload": "s", "mode": "adaptive", "request_rate": 16, "date": "1"}]
    new = replace_record(old, {"workload": "w", "mode": "adaptive", "date": "2"})
    assert [(r["workload"], r["mode"], r["date"]) for r in new] == [
        ("w", "dp2", "1"), ("v", "adaptive", "1"), ("s", "adaptive", "1"), ("s", "adaptive", "1"),
        ("w", "adaptive", "2")]
    rates = replace_record(new, {"workload": "s", "mode": "adaptive", "request_rate": 16, "date": "2"})
    assert [(r.get("request_rate"), r["date"]) for r in rates if r["workload"] == "s"] == [(12, "1"), (16, "2")]


def test_the_four_gpu_layout_and_the_rate_scale() -> None:
    assert mode_flags("static_2p2d", SLO, None, "x4") == ["--disagg-policy", "static", "--prefill-workers", "2",
                                                          "--decode-workers", "2"]
    assert mode_flags("dp4", SLO, None, "x4") == ["--disagg-policy", "static", "--data-parallel-size", "4"]
    assert " ".join(mode_flags("adaptive", SLO, None, "x4")).startswith(
        "--disagg-policy adaptive --prefill-workers 1 --decode-workers 3")
    (mixed,) = plan("mixed", False, [], 0.0, rate_scale=2.0)
    assert {t.name: t.rate for t in mixed.phases[0].classes} == {"chat": 20.0, "doc": 2.0}
    sweep = plan("sweep", False, [12, 16], 15.0, rate_scale=2.0)
    assert [w.rate for w in sweep] == [24.0, 32.0] and sweep[0].phases[0].classes[0].rate == 24.0


def router_metrics(pools: dict[str, str], moves: int) -> str:
    """The text `kvflow serve`'s router renders: a 0/1 gauge per worker and pool, a moves counter."""
    rows = [f'kvflow:worker_pool{{pool="{pool}",worker="{w}"}} {float(pool == mine)}'
            for w, mine in pools.items() for pool in ("prefill", "decode")]
    return "\n".join(["# TYPE kvflow:worker_pool gauge", *rows, "# TYPE kvflow:pool_moves counter",
                      f'kvflow:pool_moves_total{{from="decode",to="prefill"}} {moves}.0',
                      "# TYPE kvflow:worker_num_requests_waiting gauge",
                      *[f'kvflow:worker_num_requests_waiting{{worker="{w}"}} {moves}.0' for w in pools],
                      "# TYPE kvflow:prefill_path_decisions counter",
                      f'kvflow:prefill_path_decisions_total{{path="local",reason="faster_local"}} {moves}.0', ""])


def test_pools_parsed_from_the_router_metrics_and_the_adaptation_timed() -> None:
    one, two, three = {"a": "prefill", "b": "decode"}, {"a": "prefill", "b": "prefill"}, {"a": "decode", "b": "prefill"}
    assert parse_pools(router_metrics(one, 3)) == (one, 3.0, {"a": [0.0, 3.0], "b": [0.0, 3.0]},
                                                    {"local/faster_local": 3.0})
    # Phase 2 starts at 60 s: b moves to prefill at 61.0 s, a poll fails at 61.5, a moves to decode at 63.5.
    polls = [(0.0, one, 1), (30.0, one, 1), (61.0, two, 2), (63.5, three, 3), (70.0, three, 3)]
    samples = [(t, *parse_pools(router_metrics(pools, moves))) for t, pools, moves in polls]
    record = pool_record([*samples[:3], (61.5, None, None, {}, {}), *samples[3:]], change_at=60.0)
    assert record["pool_moves"] == 2.0 and record["metrics_poll_failures"] == 1
    assert record["seconds_to_adapt"] == 3.5 and [e["pools"] for e in record["pool_timeline"]] == [one, two, three]
    assert pool_record(samples[:2], change_at=60.0)["seconds_to_adapt"] == 0.0
    assert pool_record([(0.0, {}, None, {}, {})], change_at=60.0) == {"pool_moves": None, "metrics_poll_failures": 0,
                                                              "seconds_to_adapt": None, "pool_timeline": None}


def test_smoke_records_every_field_for_every_mode(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "bench.pd_adaptive", "--smoke", "--out", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    path = tmp_path / "pd_adaptive_smoke.json"
    assert path.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    payload = json.loads(path.read_text())
    assert {"device", "commit", "date", "mode_flags", "slo"} <= payload["context"].keys()
    records = payload["records"]
    errors = {r["mode"]: r["error"][-500:] for r in records if "error" in r}
    assert not errors, errors
    seen = {(r["mode"], r["workload"].split("pd_adaptive_")[1].rsplit("_tiny")[0]) for r in records}
    assert seen == {(m, w) for m in MODE_FLAGS if m not in OPT_IN_MODES for w in WORKLOADS}
    for r in records:
        assert r.keys() >= FIELDS, (r["mode"], r["workload"], FIELDS - r.keys())
        assert r["failed"] == 0 and r["requests"] > 0, (r["mode"], r["workload"], r["errors"])
        assert r["slo"].keys() == {"ttft_s", "itl_s"} and 0.0 <= r["slo_attainment"] <= 1.0
        if "changing" in r["workload"]:
            assert {"seconds_to_adapt", "pool_timeline"} <= r.keys() and len(r["phases"]) == 2
        if "mixed" in r["workload"]:
            assert r["classes"]["chat"]["itl_max_s"] is not None and r["classes"]["doc"]["ttft_p99_s"] is not None
    adaptive = [r for r in records if r["mode"] == "adaptive" and "changing" in r["workload"]]
    assert all(r["pool_moves"] is not None for r in adaptive), "adaptive exports kvflow:pool_moves_total"
    for r in records:  # the diagnostics: where each request was prefilled, and how the backlog moved
        assert sum(r["prefill_path_decisions"].values()) >= r["requests"] or r["mode"] != "adaptive", r
        assert sum(b["requests"] for b in r["load_timeline"]) == r["requests"] - r["failed"]
    assert done.returncode == 0, done.stdout[-3000:]
