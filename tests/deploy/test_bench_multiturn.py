"""`kvflow bench multiturn` (issue 31 item 4): the workload is seeded and shared across modes, the record has the
issue's fields computed from the turns, and bad settings are refused before any server starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.benchmarks.multiturn import TurnResult, Workload, run_multiturn, summarize, user_turns


def test_conversations_share_the_system_prompt_and_are_seeded() -> None:
    workload = Workload(conversations=3, turns=2, system_len=5, user_len=4, output_len=2, seed=7)
    system, turns = user_turns(workload)
    assert len(system) == 5 and len(turns) == 3 and all(len(t) == 2 and len(t[0]) == 4 for t in turns)
    assert user_turns(workload) == (system, turns)
    assert user_turns(Workload(conversations=3, turns=2, system_len=5, user_len=4, output_len=2, seed=8)) != (
        system, turns)


def test_the_record_has_the_issue_fields() -> None:
    workload = Workload(conversations=2, turns=2, system_len=4, user_len=2, output_len=2)
    results = [[TurnResult(True, 6, 0, [1, 2], 0.5, [0.1]), TurnResult(True, 10, 8, [3, 4], 0.1, [0.2])],
               [TurnResult(True, 6, 4, [1, 2], 0.3, [0.1]), TurnResult(False, 10, error="boom")]]
    metrics = ('vllm:external_prefix_cache_hits_total{role="prefill"} 3\n'
               'vllm:external_prefix_cache_hits_total{role="decode"} 1\n'
               'vllm:external_prefix_cache_hits_created{role="decode"} 1.7e9\n'
               "kvflow:route_false_hits_total 0\nkvflow:route_false_hits_created 1.7e9\n"
               'kvflow:prefix_fetch_decisions_total{path="fetch",reason="cheaper_fetch"} 2\n'
               'kvflow:prefix_fetch_decisions_total{path="recompute",reason="cheaper_recompute"} 5\n'
               'kvflow:kv_host_dropped_blocks_total{role="decode"} 7\n')
    record = summarize("host_tier", "cpu", workload, results, 2.0, metrics)
    assert record["mode"] == "host_tier" and record["device"] == "cpu" and record["workload"]["conversations"] == 2
    assert record["prefix_hit_rate"] == {"total": 12 / 22, "host": 4 / 22}
    assert record["false_hits"] == 0 and record["completed"] == 3 and record["failed"] == 1
    assert record["fetches"] == 2 and record["host_dropped_blocks"] == 7
    assert record["out_tok_s"] == 3.0 and record["ttft_p50_s"] == pytest.approx(0.3)
    assert record["ttft_p50_s_by_turn"] == pytest.approx([0.4, 0.1])  # turn 0: 0.5 and 0.3; turn 1: 0.1 (one failed)
    assert record["errors"] == ["boom"]
    assert summarize("no_tier", "cpu", workload, results, 2.0, "")["false_hits"] is None  # not counted: null
    assert summarize("no_tier", "cpu", workload, results, 2.0, "")["fetches"] is None


@pytest.mark.parametrize(("modes", "workload", "match"), [
    (["bogus"], Workload(), "unknown mode"), (["no_tier"], Workload(turns=0), "--turns")])
def test_bad_settings_are_refused_before_serving(tmp_path: Path, modes: list[str], workload: Workload,
                                                 match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_multiturn(["--model", "smollm2"], modes, workload, 1.0, 10.0, tmp_path)
