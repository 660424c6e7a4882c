"""`kvflow bench multiturn` (kvflow/benchmarks/multiturn.py): the conversations' shape, its refusals, and one run of
the host-tier mode on `tiny` workers (1 prefill + 1 decode, a 15-block device cache, three conversations at once):
every turn completes, the host tier serves part of the prompts, no request is a false hit, and the record has the
issue's fields."""

from __future__ import annotations

import pytest

from engine.arg_utils import EngineArgs
from kvflow.benchmarks.multiturn import run_multiturn_bench
from kvflow.benchmarks.multiturn_workload import Workload, make_conversations

SMALL = Workload(conversations=3, turns=3, system_len=64, user_len=32, assistant_len=32, output_len=4,
                 max_concurrency=3)
TINY = EngineArgs(model="tiny", num_gpu_blocks_override=16, max_model_len=240, kv_offloading_size=0.0005)


def test_turns_extend_each_other_and_share_the_system_prompt() -> None:
    conversations = make_conversations(SMALL, seed=1, vocab=400)
    assert len(conversations) == 3 and all(len(c) == 3 for c in conversations)
    for turns in conversations:
        assert turns[0][:64] == conversations[0][0][:64]  # one system prompt for all
        for before, after in zip(turns, turns[1:], strict=False):
            assert after[: len(before)] == before and len(after) == len(before) + 32 + 32
    assert len(conversations[0][-1]) == SMALL.max_prompt_tokens == 224
    assert conversations[0][1] != conversations[1][1]


def test_refusals_name_the_argument() -> None:
    with pytest.raises(ValueError, match="--user-len must be >= 1"):
        Workload(user_len=0)
    with pytest.raises(ValueError, match="needs --kv-offloading-size"):
        run_multiturn_bench(EngineArgs(model="tiny"), SMALL, 1, 1, ("host-tier",))
    with pytest.raises(ValueError, match="unknown --modes"):
        run_multiturn_bench(TINY, SMALL, 1, 1, ("fetch",))


def test_host_tier_mode_serves_from_the_host_without_false_hits() -> None:
    [record] = run_multiturn_bench(TINY, SMALL, 1, 1, ("host-tier",))
    assert {"workload", "device", "mode", "ttft_p50_s", "ttft_p99_s", "prefix_hit_rate", "false_hits", "itl_p99_s",
            "out_tok_s"} <= set(record)
    assert record["mode"] == "host-tier" and record["device"] == "cpu"
    assert (record["completed"], record["failed"]) == (9, 0)
    assert record["false_hits"] == 0
    assert 0 < record["prefix_hit_rate"]["host"] <= record["prefix_hit_rate"]["total"] <= 1
