"""Tensor-parallel prefill/decode disaggregation on 4 GPUs, checked and timed in one call: every (prefill rank,
decode rank) pair moves its KV heads over NCCL (cluster/transfer/link/heads.py), never through rank 0.

Layouts (GPU indices among the visible ones; a TP-N worker takes N consecutive GPUs from its first):
  tp2_to_tp2     a TP2 prefill worker on GPUs 0-1 -> a TP2 decode worker on GPUs 2-3
  tp2_to_2x_tp1  a TP2 prefill worker on GPUs 0-1 -> two TP1 decode workers on GPUs 2 and 3 (requests to both)
  tp1_to_tp1     the reference: a TP1 prefill worker on GPU 0 -> a TP1 decode worker on GPU 2

Parts (`--parts`, in this order), each writing $OUT/tp_pd_x4_<part>.json as soon as it finishes (and again after
each layout, so a part cut short keeps what it measured):
  check     token-exact, tiny fp32 (2 KV heads: one per rank at TP2): greedy ids through P/D over NCCL equal the
            same decode worker's local prefill at 3, 200 and 990 prompt tokens, for all three layouts, one request
            at a time and then all at once (both decode workers' links busy together); PASS/FAIL per layout. The
            three clusters start together (fixed KV pools: no worker's memory profile sees another's) and are
            checked one after another
  transfer  Llama-3.1-8B shapes (dummy weights, bf16), `kvflow bench pd` (kvflow.benchmarks.pd.run_pd_bench,
            given the per-role TP sizes and, for tp2_to_2x_tp1, both decode workers measured in turn) for
            tp2_to_tp2 and tp2_to_2x_tp1: TTFT disaggregated vs local prefill and KV transfer GB/s (every decode
            rank's heads over the decode side's wire time) at 1k / 4k / 16k prompt tokens
  mixed70b  Llama-3.1-70B shapes (dummy, bf16), `kvflow serve` under pd_adaptive's mixed load (chat 512 / 256 at
            10 req/s + documents 8,192 / 32 at 1 req/s, 30 s; its load, client and SLO metrics, imported): a TP2
            prefill worker (GPUs 0-1) + a TP2 decode worker (GPUs 2-3), static P/D, against two TP2 unified
            replicas (`--data-parallel-size 2 -tp 2`), one server after the other

Records carry `workload`, `device` ("4 x <gpu name>"), `layout`; transfer records `prompt_tokens`,
`transfer_gbps`, `ttft_disagg_s`, `ttft_local_s` (and `driver`: how they were measured); mixed70b records
pd_adaptive's fields (`slo_attainment`, `ttft_p99_s`, `itl_p99_s`, per class) and `mode_flags`. Every cluster is started
with a ready timeout and stopped on the way out; each part runs under a wall-clock limit (SIGALRM raises in the
waiting call), within `--budget-s` for the whole call. Measured on 4 x H200 (2026-11-27): check ~75 s (beside
moe_pp_x4's check), transfer 116 s (two 8B clusters, ~60 s each with their start); mixed70b alone 295 s at the
two-GPU rates (both layouts overloaded at 70B) and 223 s at `--rate-scale 0.3`, the load the 70B layouts carry.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \\
        python -m bench.tp_pd_x4 --parts check transfer --out $OUT  # --log-dir $OUT/logs: worker logs back too

`--smoke`: the same code paths on CPU (gloo links, the tiny model, small KV pools and prompts).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness.jobs import MULTICAST_OFF
from bench.harness.records import RESULTS, log, run_parts, write_json
from bench.harness.runs import first_divergence
from engine.arg_utils import EngineArgs
from kvflow.benchmarks.pd import LOCAL_ONLY, device_name, ready_workers, run_pd_bench
from protos.kvflow.v1 import kvflow_pb2 as pb

CHECK_LENGTHS = (3, 200, 990)
CHECK_MAX_TOKENS = 16
TRANSFER_MODEL = "llama-3.1-8b"
SMOKE_KV_BYTES = 32 << 20  # CPU workers: a small pool allocates in no time
CHECK_KV_BYTES = 256 << 20  # the tiny check's pool on GPUs: fixed, so three clusters may start side by side
# Wall-clock limits per part on GPUs (the call's own limit is 10 min); --smoke on a shared 2-core CPU gets more.
PART_LIMIT_S = {"check": 240.0, "transfer": 330.0, "mixed70b": 560.0}
SMOKE_PART_LIMIT_S = {"check": 900.0, "transfer": 900.0, "mixed70b": 900.0}
MIXED_MODEL = ["--model", "llama-3.1-70b", "--load-format", "dummy"]


@dataclass(frozen=True)
class Layout:
    name: str
    prefill_tp: int
    decode_tp: int
    decode_workers: int
    prefill_gpus: tuple[int, ...]  # first GPU of each worker
    decode_gpus: tuple[int, ...]


LAYOUTS = {layout.name: layout for layout in (
    Layout("tp2_to_tp2", 2, 2, 1, (0,), (2,)),
    Layout("tp2_to_2x_tp1", 2, 1, 2, (0,), (2, 3)),
    Layout("tp1_to_tp1", 1, 1, 1, (0,), (2,)),
)}
CHECK_LAYOUTS = ("tp2_to_tp2", "tp2_to_2x_tp1", "tp1_to_tp1")
TRANSFER_LAYOUTS = ("tp2_to_tp2", "tp2_to_2x_tp1")


@dataclass(frozen=True)
class Setup:
    """What every part is given: where results go, whether this is the CPU smoke, the call's deadline."""

    out: Path
    log_dir: Path  # each cluster's worker logs in a folder of its own (their tails are printed when a step fails)
    smoke: bool
    deadline: float  # time.monotonic() by which every part must be done
    device: str
    layouts: tuple[str, ...]  # --layouts: the ones to run, of each part's own
    rate_scale: float = 1.0  # mixed70b: every class's rate times this (pd_adaptive's --rate-scale)

    def chosen(self, names: tuple[str, ...]) -> list[str]:
        return [name for name in names if name in self.layouts]

    def write(self, part: str, payload: Any) -> None:
        write_json(self.out / f"tp_pd_x4_{part}.json", payload, indent=1)

    def remaining_s(self) -> float:
        return self.deadline - time.monotonic()

    def part_limit_s(self, part: str) -> float:
        return min((SMOKE_PART_LIMIT_S if self.smoke else PART_LIMIT_S)[part], self.remaining_s())

    def gpus(self, layout: Layout) -> dict[str, tuple[int, ...] | None]:
        """Where the layout's workers go; the CPU smoke places nothing."""
        if self.smoke:
            return {"prefill_gpus": None, "decode_gpus": None}
        return {"prefill_gpus": layout.prefill_gpus, "decode_gpus": layout.decode_gpus}

    def describe(self, layout: Layout) -> dict[str, Any]:
        """A record's account of the layout: its name, TP sizes, decode workers and where they ran."""
        return {"layout": layout.name, "prefill_tp": layout.prefill_tp, "decode_tp": layout.decode_tp,
                "decode_workers": layout.decode_workers, **self.gpus(layout)}

    def memory(self, gpu_kv_bytes: int | None = None) -> dict[str, Any]:
        """EngineArgs fields sizing the KV pool: small on CPU; on GPUs `gpu_kv_bytes`, or (None) from each worker's
        memory share."""
        kv_bytes = SMOKE_KV_BYTES if self.smoke else gpu_kv_bytes
        return {} if kv_bytes is None else {"kv_cache_memory_bytes": kv_bytes}

    def logs(self, part: str, layout: Layout) -> Path:
        return self.log_dir / f"{part}-{layout.name}"

    def print_log_tails(self, part: str, layout: Layout) -> None:
        for path in sorted(self.logs(part, layout).glob("*.log")):
            log(f"--- {path} ---\n" + path.read_text(errors="replace")[-2500:])


class PartTimeout(TimeoutError):
    pass


@contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Raise PartTimeout in the main thread after `seconds` (a blocking gRPC wait wakes for signals), so a hung
    step ends its part, and the clusters it started are stopped on the way out, instead of eating the lease."""
    def expire(signum: int, frame: Any) -> None:
        raise PartTimeout(f"{what} still running after {seconds:.0f} s")

    if seconds <= 0:
        raise PartTimeout(f"no time left for {what}")
    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_spec(setup: Setup, layout: Layout) -> Any:
    """The check's cluster of `layout` (the transfer's is run_pd_bench's own, from the same layout): tiny fp32,
    64-token chunks, so a long prompt crosses as many slices, each exported right after its step on every rank."""
    from cluster.auth import ClusterAuth
    from kvflow.launcher import ClusterSpec

    args = EngineArgs(model="tiny", load_format="dummy", dtype="float32", max_model_len=1024, usage_context="server",
                      **setup.memory(CHECK_KV_BYTES))
    return ClusterSpec(args, prefill_workers=1, decode_workers=layout.decode_workers, kv_transfer_backend="nccl",
                       auth=ClusterAuth().with_token(), prefill_tensor_parallel_size=layout.prefill_tp,
                       decode_tensor_parallel_size=layout.decode_tp,
                       worker_extra_args=("--max-num-batched-tokens", "64"), log_dir=setup.logs("check", layout),
                       **setup.gpus(layout))


def ready_timeout_s(setup: Setup) -> float:
    return max(min(300.0, setup.remaining_s() - 30), 10.0)


# ---- check ------------------------------------------------------------------------------------------------------
def check_prompt(i: int, length: int) -> list[int]:
    return [(7919 * (i + 1) * (k + 3)) % 400 + 50 for k in range(length)]  # tiny: 512 ids


def greedy(stub: Any, prompt: list[int], prefill: str, local: bool, salt: str) -> tuple[list[int], bool]:
    """(greedy ids, whether the prefill came over the link). The salt keeps each path off the other's cache."""
    request = pb.GenerateRequest(
        token_ids=pb.TokenIds(ids=prompt), cache_salt=[salt],
        sampling_params=pb.SamplingParams(temperature=0.0, max_tokens=CHECK_MAX_TOKENS, ignore_eos=True),
        disaggregation=pb.DisaggregationParams(prefill_address=prefill, min_prompt_tokens=LOCAL_ONLY if local else 0))
    complete = list(stub.Generate(request, timeout=120))[-1].complete
    return list(complete.choices[0].token_ids), complete.prefill_path == pb.PREFILL_PATH_DISAGGREGATED


def compare(expected: list[int], got: tuple[list[int], bool], decode: int, length: int, mode: str) -> dict[str, Any]:
    ids, remote = got
    return {"decode_worker": decode, "prompt_tokens": length, "mode": mode, "equal": ids == expected,
            "disaggregated_path": remote, "first_divergence": first_divergence(ids, expected)}


def check_layout(setup: Setup, layout: Layout, cluster: Any) -> dict[str, Any]:
    """On `layout`'s started cluster: local prefill on each decode worker first (the reference), then P/D one
    request at a time, then every (decode worker, length) at once."""
    rows: list[dict[str, Any]] = []
    with ready_workers(cluster, ready_timeout_s(setup)) as (prefill, decodes):
        log(f"{layout.name}: workers ready")
        cases = [(d, i, length) for d in range(len(decodes)) for i, length in enumerate(CHECK_LENGTHS)]
        local = {(d, i): greedy(decodes[d][1], check_prompt(i, n), prefill, True, "local")[0] for d, i, n in cases}
        for d, i, n in cases:
            rows.append(compare(local[d, i], greedy(decodes[d][1], check_prompt(i, n), prefill, False, "pd"), d, n,
                                "sequential"))
        pool = ThreadPoolExecutor(len(cases))
        try:
            futures = {(d, i, n): pool.submit(greedy, decodes[d][1], check_prompt(i, n), prefill, False, "pd-at-once")
                       for d, i, n in cases}
            rows += [compare(local[d, i], f.result(), d, n, "concurrent") for (d, i, n), f in futures.items()]
        finally:  # out of time: don't wait for hung calls here; closing the channels ends them
            pool.shutdown(wait=False, cancel_futures=True)
        for row in rows:  # before the cluster stops: a slow stop must not hide the verdicts
            ok = row["equal"] and row["disaggregated_path"]
            log(f"{'PASS' if ok else 'FAIL'} {layout.name} decode worker {row['decode_worker']}, "
                f"{row['prompt_tokens']} tokens, {row['mode']}: P/D == local prefill (disaggregated path: "
                f"{row['disaggregated_path']}"
                + ("" if row["first_divergence"] is None else f", first divergence at {row['first_divergence']}")
                + ")")
    return {**setup.describe(layout), "checks": rows,
            "pass": all(r["equal"] and r["disaggregated_path"] for r in rows)}


def part_check(setup: Setup) -> dict[str, Any]:
    from kvflow.launcher import WorkerCluster

    record: dict[str, Any] = {"workload": "tp_pd_nccl_token_exact_tiny_fp32", "device": setup.device,
                              "max_tokens": CHECK_MAX_TOKENS, "cases": [], "pass": False}
    with ExitStack() as stack:  # every cluster stopped, whatever happens
        clusters = {name: stack.enter_context(WorkerCluster(check_spec(setup, LAYOUTS[name])))
                    for name in setup.chosen(CHECK_LAYOUTS)}
        for name in clusters:
            check_one(setup, name, clusters[name], record)
            clusters[name].stop()  # its GPUs and cores to the ones left
    return record


def check_one(setup: Setup, name: str, cluster: Any, record: dict[str, Any]) -> None:
    """Check one layout into `record` and write it; PartTimeout goes on up (the part is out of time)."""
    started = time.monotonic()
    error: Exception | None = None
    try:
        case = check_layout(setup, LAYOUTS[name], cluster)
    except Exception as exc:  # one layout's failure is its FAIL; the next layout still runs (unless out of time)
        log(f"FAIL {name}: {type(exc).__name__}: {exc}")
        setup.print_log_tails("check", LAYOUTS[name])
        case, error = {**setup.describe(LAYOUTS[name]), "pass": False,
                       "error": f"{type(exc).__name__}: {exc}"}, exc
    log(f"{name} took {time.monotonic() - started:.0f} s")
    record["cases"].append({**case, "seconds": round(time.monotonic() - started, 1)})
    record["pass"] = all(c["pass"] for c in record["cases"]) and \
        len(record["cases"]) == len(setup.chosen(CHECK_LAYOUTS))
    setup.write("check", record)
    if isinstance(error, PartTimeout):
        raise error


# ---- transfer ---------------------------------------------------------------------------------------------------
DRIVER = ("kvflow.benchmarks.pd.run_pd_bench (`kvflow bench pd`) with per-role tensor-parallel sizes; several decode "
          "workers are measured in turn, one request at a time, every run naming its decode_worker")


def transfer_layout(setup: Setup, layout: Layout, prompt_lens: list[int], reps: int) -> list[dict[str, Any]]:
    model = "tiny" if setup.smoke else TRANSFER_MODEL
    args = EngineArgs(model=model, load_format="dummy", max_model_len=max(prompt_lens) + 64, **setup.memory())
    gpus = setup.gpus(layout)
    records = run_pd_bench(args, prompt_lens, reps, output_len=4, kv_transfer_backend="nccl",
                           prefill_gpus=gpus["prefill_gpus"], decode_gpus=gpus["decode_gpus"],
                           gpu_memory_utilization=None if setup.smoke else 0.9,
                           prefill_tensor_parallel_size=layout.prefill_tp,
                           decode_tensor_parallel_size=layout.decode_tp, decode_workers=layout.decode_workers,
                           ready_timeout_s=ready_timeout_s(setup), log_dir=setup.logs("transfer", layout))
    for r in records:
        log(f"{layout.name} {r['prompt_tokens']:>6} tokens: transfer {r['transfer_ms']:.2f} ms = "
            f"{r['transfer_gbps'] or 0:.1f} GB/s ({r['transfer_share_of_ttft']:.1%} of TTFT); TTFT disaggregated "
            f"{r['ttft_disagg_s'] * 1e3:.1f} ms vs local {r['ttft_local_s'] * 1e3:.1f} ms = {r['ttft_ratio']:.2f}x")
    return [{**r, "workload": f"tp_pd_transfer_{model}_{layout.name}_{r['prompt_tokens']}", "device": setup.device,
             "layout": layout.name, "gpus": gpus, "driver": DRIVER} for r in records]


def part_transfer(setup: Setup, prompt_lens: list[int], reps: int) -> list[dict[str, Any]]:
    records: list[dict[str, Any]] = []
    failures = []
    for name in setup.chosen(TRANSFER_LAYOUTS):
        started = time.monotonic()
        error: Exception | None = None
        try:
            records += transfer_layout(setup, LAYOUTS[name], prompt_lens, reps)
        except Exception as exc:  # the other layout may still be measured (unless out of time)
            log(f"transfer {name} FAILED: {type(exc).__name__}: {exc}")
            setup.print_log_tails("transfer", LAYOUTS[name])
            failures.append(name)
            error = exc
        log(f"{name} took {time.monotonic() - started:.0f} s")
        setup.write("transfer", records)
        if isinstance(error, PartTimeout):
            raise error
    if failures:
        raise RuntimeError(f"transfer failed for {', '.join(failures)}")
    return records


# ---- mixed70b ---------------------------------------------------------------------------------------------------
def mixed_modes(gpus: bool) -> dict[str, list[str]]:
    """`kvflow serve` flags of the two layouts, both static (serve's default policy is adaptive). On GPUs each
    worker takes 0.95 of its GPUs: 70B bf16 at TP2 is ~66 GiB of weights per GPU, and 0.9 of an 80 GB H100 would
    leave ~1 GiB for KV."""
    placed = ["--prefill-gpus", "0", "--decode-gpus", "2", "--gpu-memory-utilization", "0.95"] if gpus else []
    return {
        "tp2_prefill_tp2_decode": ["--disagg-policy", "static", "--prefill-workers", "1", "--decode-workers", "1",
                                   "--prefill-tensor-parallel-size", "2", "--decode-tensor-parallel-size", "2",
                                   "--kv-transfer-backend", "nccl", *placed],
        "2x_tp2_unified": ["--disagg-policy", "static", "--data-parallel-size", "2", "--tensor-parallel-size", "2",
                           *placed[4:]],
    }


def part_mixed70b(setup: Setup) -> list[dict[str, Any]]:
    """pd_adaptive's mixed workload (its plan, arrivals, warm-up, client and metrics) on each layout in turn."""
    import secrets

    from bench import pd_adaptive
    from bench.pd_gpu import SMOKE_MODEL
    from bench.pd_gpu import Setup as ServeSetup

    model = SMOKE_MODEL if setup.smoke else MIXED_MODEL
    serve_logs = setup.log_dir / "mixed70b"
    serve_logs.mkdir(parents=True, exist_ok=True)
    flags = mixed_modes(not setup.smoke)
    bench = pd_adaptive.Bench(ServeSetup(setup.out, serve_logs, model, not setup.smoke),
                              pd_adaptive.SMOKE_SLO if setup.smoke else pd_adaptive.SLO, flags, 0,
                              1 if setup.smoke else 3, setup.device, secrets.token_hex(8),
                              rate_scale=setup.rate_scale)
    records: list[dict[str, Any]] = []
    runs = pd_adaptive.plan("mixed", setup.smoke, [], 0.0, setup.rate_scale)
    for _, record in pd_adaptive.run_group(bench, list(flags), runs, together=False):
        records.append({**record, "workload": f"tp_pd_x4_mixed_{model[1]}", "layout": record["mode"],
                        "mode_flags": flags[record["mode"]]})
        setup.write("mixed70b", records)
    errors = [r["layout"] for r in records if "error" in r]
    if errors:
        raise RuntimeError(f"mixed70b failed for {', '.join(errors)}")
    return records


# ---- main -------------------------------------------------------------------------------------------------------
def run_part(part: str, setup: Setup, args: argparse.Namespace) -> bool:
    """Run one part under its time limit; False where it failed."""
    with time_limit(setup.part_limit_s(part), f"part {part}"):
        if part == "check":
            return part_check(setup)["pass"]
        if part == "transfer":
            part_transfer(setup, args.prompt_lens, args.reps)
        else:
            part_mixed70b(setup)
        return True


def device_label(smoke: bool) -> str:
    import torch

    count = torch.cuda.device_count()
    return f"{count} x {device_name()}" if count and not smoke else f"cpu: {device_name()}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=("check", "transfer", "mixed70b"),
                        default=["check", "transfer"])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", RESULTS)))
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=None, help="transfer (default 1024 4096 16384)")
    parser.add_argument("--reps", type=int, default=3, help="transfer: timed runs per path and decode worker")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-clock seconds for the whole call (default 560: under a 10-minute lease call)")
    parser.add_argument("--layouts", nargs="+", choices=tuple(LAYOUTS), default=list(LAYOUTS),
                        help="check: all three; transfer: tp2_to_tp2 and tp2_to_2x_tp1 (default: all)")
    parser.add_argument("--log-dir", type=Path, default=None, help="worker logs (default: a temporary folder)")
    parser.add_argument("--rate-scale", type=float, default=1.0,
                        help="mixed70b: every rate times this (the two-GPU 8B rates overload the 70B layouts)")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, gloo links: the plumbing only")
    args = parser.parse_args()
    if args.rate_scale <= 0:
        parser.error(f"--rate-scale must be > 0, got {args.rate_scale:g}")
    import logging

    import torch

    for key, value in MULTICAST_OFF.items():  # the workers inherit it (the lent machines' multicast is unusable)
        os.environ.setdefault(key, value)
    if not args.smoke and torch.cuda.device_count() < 4:
        log(f"needs 4 GPUs, {torch.cuda.device_count()} visible (--smoke runs the plumbing on CPU)")
        return 2
    args.prompt_lens = args.prompt_lens or ([64, 256] if args.smoke else [1024, 4096, 16384])
    args.reps = 1 if args.smoke else args.reps
    budget = args.budget_s or (1800.0 if args.smoke else 560.0)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="tp-pd-x4-"))
    setup = Setup(args.out, log_dir, args.smoke, time.monotonic() + budget, device_label(args.smoke),
                  tuple(args.layouts), args.rate_scale)
    log(f"device {setup.device}; parts {' '.join(args.parts)}; budget {budget:.0f} s; worker logs in {log_dir}")
    failures = run_parts(args.parts, lambda part: run_part(part, setup, args))
    log("all parts passed" if not failures else f"failed: {', '.join(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
