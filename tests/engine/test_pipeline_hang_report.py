"""Hang reports (engine/parallel/hang_report.py): a parallel task (a step, a frame written to a rank) that runs past
KVFLOW_TP_HANG_REPORT_S is logged once on each rank in it, with the calls that rank issued during it and every
thread's stack, so a hang on GPUs (where NCCL never times out) says which rank waits for whom."""

from __future__ import annotations

import contextlib
import os
import re
import time

import pytest

from engine.arg_utils import EngineArgs
from engine.llm_engine import LLMEngine
from engine.parallel.hang_report import CallLog, HangWatch, hang_report_s, thread_stacks, write_whole
from engine.sampling_params import SamplingParams


def test_an_overdue_task_is_reported_once_with_its_calls_and_the_stacks(capfd: pytest.CaptureFixture[str],
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    calls = CallLog()
    watch = HangWatch("rank 3 (tensor rank 1 of 2, stage 0 of 2)", 0.2, lambda: "2 frames wait behind it")
    before = calls.snapshot()
    with watch.task("step 7 (1 chunks, 32 tokens, 1 new requests)", lambda: calls.since(before)):
        calls.record("all_reduce", (32, 64), "torch.bfloat16")
        calls.record("all_reduce", (32, 64), "torch.bfloat16")
        calls.record("send", (2, 32, 64), "torch.bfloat16", peer=1)
        deadline = time.monotonic() + 10
        while watch.reports == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # still overdue: no second report
    with watch.task("step 8"):  # done in time: none
        pass
    time.sleep(0.4)
    watch.close()
    assert watch.reports == 1
    text = caplog.text
    assert re.search(r"rank 3 \(tensor rank 1 of 2, stage 0 of 2\): step 7 \(1 chunks, 32 tokens, 1 new requests\) "
                     r"has run for \d+ s", text)
    assert "all_reduce x2, send rank 1 x1 (last ever: send rank 1 [2, 32, 64] bfloat16)" in text
    assert "2 frames wait behind it" in text and "step 8" not in text
    assert "test_an_overdue_task_is_reported_once" in capfd.readouterr().err  # the stacks (faulthandler)


def test_a_task_that_ended_before_its_report_is_written_is_not_reported(caplog: pytest.LogCaptureFixture) -> None:
    """A starved watch thread finds a task overdue, and the task ends before the report is written: no report (its
    stacks would show the rank after the task, and nothing is stuck)."""
    watch = HangWatch("rank 1", 0.1)
    watch.close()  # this test drives the reports itself
    with watch.task("step 1"):
        late = watch.overdue(time.monotonic() + 1.0)
    assert [what for _, what, _, _ in late] == ["step 1"]
    watch.overdue = lambda now: late  # type: ignore[method-assign]  # what the starved thread had computed
    assert watch.report_overdue() == 0 and watch.reports == 0
    assert "step 1" not in caplog.text


def test_the_stacks_go_out_in_one_piece() -> None:
    """Two ranks that report at once share one stderr: faulthandler alone writes each line in pieces, and the
    ranks' lines interleaved mid-line ("line 176 in Thread 0x...main") in a CI run. Buffered, each dump is whole."""
    stacks = thread_stacks()
    assert b"in test_the_stacks_go_out_in_one_piece" in stacks and stacks.endswith(b"\n")
    read, write = os.pipe()
    try:
        write_whole(write, stacks)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            assert pipe.read() == stacks
    finally:
        with contextlib.suppress(OSError):
            os.close(write)


def test_reports_are_off_at_zero_and_the_setting_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    watch = HangWatch("rank 0", 0)
    with watch.task("step 0"):
        assert watch.overdue(time.monotonic() + 1e6) == []
    monkeypatch.setenv("KVFLOW_TP_HANG_REPORT_S", "5")
    assert hang_report_s() == 5.0
    monkeypatch.delenv("KVFLOW_TP_HANG_REPORT_S")
    assert hang_report_s() == 30.0
    for bad in ("-1", "soon"):
        monkeypatch.setenv("KVFLOW_TP_HANG_REPORT_S", bad)
        with pytest.raises(ValueError, match="KVFLOW_TP_HANG_REPORT_S"):
            hang_report_s()


def test_a_stage_stuck_in_a_step_is_reported_by_it_and_by_the_stage_waiting_for_it(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """PP2 on CPU: stage 0 (world rank 1) sleeps 4 s in its second step; with reports after 1 s, it reports that
    step with its stack (in the sleep), and rank 0 (the last stage) reports the same step waiting in its receive
    from rank 1; then the step completes and the engine goes on."""
    monkeypatch.setenv("KVFLOW_TP_HANG_REPORT_S", "1")
    args = EngineArgs(model="tiny", load_format="dummy", kv_cache_memory_bytes=1 << 24, pipeline_parallel_size=2)
    engine = LLMEngine.from_engine_args(args, rank_module="tests.helpers.slow_rank",
                                        rank_env={"KVFLOW_TEST_SLOW_STEP": "1", "KVFLOW_TEST_SLOW_S": "4"})
    try:
        engine.add_request("a", {"prompt_token_ids": [1, 5, 9, 33]},
                           SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine.shutdown()
    err = capfd.readouterr().err
    assert re.search(r"rank 1 \(tensor rank 0 of 1, stage 0 of 2\): step 1 \(1 chunks, 1 tokens, 0 new requests\) "
                     r"has run for \d+ s", err)
    assert "in execute_slowly" in err  # rank 1's stack
    assert re.search(r"rank 0 \(tensor rank 0 of 1, stage 1 of 2\): step 1 \(1 chunks, 1 tokens, 0 new requests\) "
                     r"has run for \d+ s.*world group: recv rank 1 x1", caplog.text)  # this process: logged here


def test_the_pipe_hang_is_reported_and_ends_the_engine_instead_of_waiting_forever(
        monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> None:
    """Ranks reading rank 0's frames between steps (as before the fix), TP2 x PP2, two micro-batches of 24 x 512
    tokens: rank 0 blocks writing the second batch's step (about 100 KB, over the pipe's 64 KiB) to rank 1, which
    waits for rank 0 in the first batch's all-reduce. The reports name both ends, and rank 0's watchdog fails the
    write at KVFLOW_TP_TIMEOUT_S (before, it was outside the step's clock: on NCCL the engine waited forever)."""
    from engine.parallel.executor import TensorParallelError

    monkeypatch.setenv("KVFLOW_TP_HANG_REPORT_S", "2")
    monkeypatch.setenv("KVFLOW_TP_TIMEOUT_S", "20")  # also the ranks' rendezvous timeout: room on a loaded box
    args = EngineArgs(model="tiny", load_format="dummy", kv_cache_memory_bytes=1 << 25, max_model_len=1024,
                      max_num_batched_tokens=12288, tensor_parallel_size=2, pipeline_parallel_size=2)
    engine = LLMEngine.from_engine_args(args, rank_module="tests.helpers.slow_rank",
                                        rank_env={"KVFLOW_TEST_READ_BETWEEN_STEPS": "1"})
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    for r in range(48):
        engine.add_request(str(r), {"prompt_token_ids": [100 + (7 * i + 13 * r) % 400 for i in range(512)]}, params)
    started = time.monotonic()
    try:
        with pytest.raises(TensorParallelError, match="writing a frame to tensor-parallel rank 1 ran past"):
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.shutdown()
    assert time.monotonic() - started < 60
    assert re.search(r"rank 0 \(tensor rank 0 of 2, stage 1 of 2\): writing a \d+-byte frame to rank 1 has run for",
                     caplog.text)
    assert re.search(r"rank 1 \(tensor rank 1 of 2, stage 1 of 2\): step 0 \(24 chunks, 12288 tokens, 24 new "
                     r"requests\) has run for \d+ s.*stage tp group: all_reduce x1 ", capfd.readouterr().err)
