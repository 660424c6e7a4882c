"""`bench/moe_pp_x4.py`'s pieces that need no GPU: the layouts each world size runs, the comparison and active
parameters its records carry, the ids check flagging a mismatch, and its fused-MoE kernel job under Triton's
interpreter (the smoke's kernel path, seconds). The whole `--smoke` (tiny engines at EP2 / TP2 / PP2 on CPU) takes
60-90 s on a 2-core box, so it is run by hand: `python -m bench.moe_pp_x4 --smoke --out /tmp/x`."""

from __future__ import annotations

from dataclasses import asdict

from bench.harness.jobs import run_jobs
from bench.moe_pp_x4 import MODULE, Bench, KernelCase, Layout, Plan, active_params, compare
from engine.models.loader import resolve_model


def test_each_world_size_runs_its_layouts_and_models() -> None:
    gpu = Plan.of(4, smoke=False)
    assert [layout.name for layout in gpu.moe_layouts] == ["ep4", "tp4"]
    assert [layout.name for layout in gpu.pp_check] == ["pp2", "tp2_pp2", "pp4"]
    assert [layout.name for layout in gpu.pp_timed] == ["tp2_pp2", "tp4"]
    assert {c.tokens for c in gpu.kernel_cases} == {1, 7, 64, 512} and gpu.ep_case.experts == 128
    assert gpu.moe_models == ("qwen3-30b-a3b",) and gpu.pp_model == "llama-3.1-70b" and gpu.moe_reference is None
    two = Plan.of(2, smoke=False)  # the MoE issue's two-GPU runs: EP2 vs TP2 on two models, PP2 vs TP2 vs replicas
    assert [layout.name for layout in two.moe_layouts] == ["ep2", "tp2"]
    assert two.moe_models == ("qwen3-30b-a3b", "mixtral-8x7b") and two.pp_model == "llama-3.1-8b"
    assert [layout.name for layout in two.pp_check] == ["pp2"]  # TP2 x PP2 needs four GPUs
    assert [layout.name for layout in two.pp_timed] == ["pp2", "tp2", "dp2"]
    one = Plan.of(1, smoke=False)  # one GPU: Qwen3-30B-A3B beside the dense Llama-3.1-8B, no pipeline
    assert [layout.name for layout in one.moe_layouts] == ["tp1"] and one.moe_reference == "llama-3.1-8b"
    assert one.pp_timed == () and one.pp_check == ()
    smoke = Plan.of(2, smoke=True)
    assert [layout.name for layout in smoke.moe_layouts] == ["ep2", "tp2"]
    assert [layout.name for layout in smoke.pp_check] == ["pp2", "tp2_pp2"]
    assert [layout.name for layout in smoke.pp_timed] == ["pp2", "tp2", "dp2"]
    assert Layout(1, dp=2).engine_args()["tensor_parallel_size"] == 1  # each replica one GPU
    assert Layout(2, 2).engine_args() == {"tensor_parallel_size": 2, "pipeline_parallel_size": 2,
                                          "enable_expert_parallel": False}


def test_records_compare_the_first_layout_to_the_second() -> None:
    rows = [{"layout": "ep4", "decode_tok_s": 150.0, "output_tok_s": 9000.0},
            {"layout": "tp4", "decode_tok_s": 100.0, "error": "timed out after 240 s"}]
    assert compare(rows) == {"of": "ep4 / tp4", "decode_tok_s": 1.5, "output_tok_s": None}
    qwen3 = resolve_model("qwen3-30b-a3b", "dummy").arch  # 30.5B parameters, 3.35B of them active
    assert round(active_params(qwen3) / 1e9, 2) == 3.35 and round(qwen3.num_params / 1e9, 1) == 30.5
    llama = resolve_model("tiny-llama", "dummy").arch
    assert active_params(llama) == llama.num_params


def test_ids_check_fails_a_layout_that_differs_or_died() -> None:
    cases = [("m", Layout(1), {}), ("m", Layout(2, ep=True), {}), ("m", Layout(2), {}), ("m", Layout(1, 2), {})]
    results = [{"ids": [[1, 2, 3]]}, {"ids": [[1, 2, 3]], "cuda_graphs": True}, {"error": "exit code 1"},
               {"ids": [[1, 2, 4]]}]
    rows = Bench.compare_ids(cases, results)
    assert [(r["layout"], r["status"]) for r in rows] == [("ep2", "PASS"), ("tp2", "FAIL"), ("pp2", "FAIL")]
    assert rows[1]["error"] == "exit code 1" and rows[1]["first_divergence"] is None
    assert rows[2]["first_divergence"] == [2]


def test_kernel_job_passes_under_the_interpreter() -> None:
    case = asdict(KernelCase(5, 8, 2, 32, 16))
    job = {"kind": "kernel", "cuda": False, "world": 2, "cases": [case], "ep_case": case}
    result = run_jobs(MODULE, [job], 240, {"TRITON_INTERPRET": "1"})[0]
    assert "rows" in result, result
    assert result["rows"][0]["status"] == "PASS" and result["rows"][0]["max_abs_err_fused"] < 0.1
    drop = result["ep_drop"]
    assert drop["status"] == "PASS" and [r["experts"] for r in drop["ranks"]] == [[0, 4], [4, 8]]


def test_a_rerun_of_one_layout_keeps_the_files_records_of_the_others(tmp_path) -> None:  # noqa: ANN001
    import json
    from types import SimpleNamespace

    (tmp_path / "moe_x4_qwen3_30b_a3b.json").write_text(json.dumps(
        {"date": "then", "argv": ["--parts", "moe"], "records": [{"layout": "ep4", "decode_tok_s": 104.0},
                                                                  {"layout": "tp4", "error": "skipped"}]}))
    bench = SimpleNamespace(smoke=False, args=SimpleNamespace(out=tmp_path, layouts=["tp4"]), plan=Plan.of(4, False))
    name = Bench.file(bench, "moe", "qwen3-30b-a3b")  # type: ignore[arg-type]
    assert name == "moe_x4_qwen3_30b_a3b.json"
    assert Bench.file(bench, "pp", "llama-3.1-70b") == "pp_x4_llama70b.json"  # type: ignore[arg-type]
    kept = Bench.kept_records(bench, name, {"tp4"})  # type: ignore[arg-type]
    assert [(r["layout"], r["decode_tok_s"], r["earlier_run"]["date"]) for r in kept] == [("ep4", 104.0, "then")]
    bench.args.layouts = None  # a full run starts its file afresh
    assert Bench.kept_records(bench, name, {"ep4", "tp4"}) == []  # type: ignore[arg-type]


def test_dispatch_ranks_time_every_collective_and_sum_exactly() -> None:
    """The dispatch part's ranks (two gloo processes, one size): each collective timed, the per-layer sums of the
    three designs, the known all-reduce exact."""
    from bench.harness.jobs import run_jobs
    from engine.parallel.executor import free_port

    port = free_port()
    jobs = [{"kind": "dispatch", "rank": r, "world": 2, "port": port, "cuda": False, "hidden": 16, "tokens": [3],
             "iters": 2} for r in range(2)]
    results = run_jobs(MODULE, jobs, 120, {})
    for rank, result in enumerate(results):
        assert result.get("rank") == rank, result
        (row,) = result["rows"]
        assert row["tokens_per_rank"] == 3 and row["bytes_per_rank"] == 3 * 16 * 4 and row["exact"]
        assert all(row[name]["eager_us"] > 0 for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all"))
        assert row["per_layer_us"]["tp_attention_two_all_reduces"] == round(2 * row["all_reduce"]["eager_us"], 2)
