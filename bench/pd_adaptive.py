"""Adaptive disaggregation against the fixed layouts, same client, loads and seeds (the adaptive-disaggregation
issue's benchmarks). Modes (`--modes`, `kvflow serve` flags in MODE_FLAGS): static_1p1d (1 prefill + 1 decode
worker, `--disagg-policy static` where serve has it), dp2 (`--data-parallel-size 2`: replicas that prefill
locally), adaptive (`--disagg-policy adaptive` from 1P1D, the SLO as its targets). `--layout x4` (the four-GPU
issue): static_2p2d, static_1p3d, dp4 (`--data-parallel-size 4`) and adaptive from 1P3D, written to
pd_adaptive_x4_<workload>.json; `--rate-scale 2` gives each GPU the two-GPU runs' load. Named only: adaptive_dp2 /
adaptive_dp4, adaptive starting as replicas (no prefill pool).

Workloads (`--workloads`): open-loop Poisson arrivals per class (own lengths and rate), phases in order; every
class and phase gets at least one request.
  mixed          chat 512 in / 256 out at 10 req/s + documents 8,192 / 32 at 1 req/s, 30 s
  prefill_heavy  2,048 / 256 at 16 req/s, 20 s
  decode_heavy   256 / 1,024 at 8 req/s, 30 s
  changing       chat 512 / 256 at 10 req/s for 60 s, then documents 8,192 / 32 at 2 req/s for 60 s
  sweep          pd_gpu's headline load: 2,048 / 256 at each of --rates for --seconds-per-rate (a record per rate)

SLO: a request meets it if it completed, its TTFT <= slo["ttft_s"] and its TPOT (mean gap per output token after
the first) <= slo["itl_s"]; slo_attainment = requests meeting it / requests sent (a failed one misses it).

Writes $OUT/pd_adaptive_<workload>.json (--smoke: pd_adaptive_smoke.json), rewritten after each mode; its
records' fields: bench/README.md. A record replaces the file's earlier one of its mode (and rate) when it is written;
the others are kept: a workload's modes can be measured over several device calls (copy the file into $OUT first: a
device's $OUT starts empty).

Servers: one per mode and workload (the same starting pools for each), warmed up with a few requests per class;
--smoke (tiny model on CPU, seconds-long loads) starts one per mode for all workloads, all three up front.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 \\
        python -m bench.pd_adaptive --workloads mixed prefill_heavy --modes static_1p1d dp2 adaptive --out $OUT
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.harness.jobs import MULTICAST_OFF
from bench.harness.records import RESULTS, log, write_json
from bench.pd_gpu import MODEL, SMOKE_MODEL, Setup
from kvflow.benchmarks.pd import device_name
from kvflow.benchmarks.serve import RequestResult, http_client, one_request
from kvflow.benchmarks.server import ServerProcess

SLO = {"ttft_s": 1.0, "itl_s": 0.040}  # the issue's, stated before measuring
SMOKE_SLO = {"ttft_s": 30.0, "itl_s": 2.0}  # --smoke checks structure on a shared CPU, not speed
SMOKE_ENGINE = ("--kv-cache-memory-bytes", str(64 << 20))  # CPU's default pool takes seconds to allocate
WORKLOADS = ("mixed", "prefill_heavy", "decode_heavy", "changing", "sweep")
MODE_FLAGS = {  # serve's default policy is adaptive: the fixed layouts pin static
    "static_1p1d": ("--disagg-policy", "static", "--prefill-workers", "1", "--decode-workers", "1"),
    "dp2": ("--disagg-policy", "static", "--data-parallel-size", "2"),
    "adaptive": ("--disagg-policy", "adaptive", "--prefill-workers", "1", "--decode-workers", "1"),
    # adaptive from replicas (no prefill pool): the planner gives a worker to prefill only when the requests' pace
    # breaks while decode workers prefill locally. Run only when named (--modes): not one of the layouts.
    "adaptive_dp2": ("--disagg-policy", "adaptive", "--data-parallel-size", "2"),
}
# The four-GPU issue's layouts. adaptive starts as 1P3D: one prefill GPU carries these loads' prompts at the
# two-GPU rates scaled by 2, and the planner moves workers from there.
MODE_FLAGS_X4 = {
    "static_2p2d": ("--disagg-policy", "static", "--prefill-workers", "2", "--decode-workers", "2"),
    "static_1p3d": ("--disagg-policy", "static", "--prefill-workers", "1", "--decode-workers", "3"),
    "dp4": ("--disagg-policy", "static", "--data-parallel-size", "4"),
    "adaptive": ("--disagg-policy", "adaptive", "--prefill-workers", "1", "--decode-workers", "3"),
    "adaptive_dp4": ("--disagg-policy", "adaptive", "--data-parallel-size", "4"),  # when named, as adaptive_dp2
}
LAYOUTS = {"x2": MODE_FLAGS, "x4": MODE_FLAGS_X4}
OPT_IN_MODES = frozenset({"adaptive_dp2", "adaptive_dp4"})  # not in a layout's default --modes
POLL_S = 0.5


def mode_flags(mode: str, slo: dict[str, float], itl_target_ms: float | None, layout: str = "x2") -> list[str]:
    """`kvflow serve` flags of a mode in `layout`; the adaptive modes get the SLO as their targets."""
    flags = list(LAYOUTS[layout][mode])
    if mode.startswith("adaptive"):
        flags += ["--slo-ttft-ms", f"{slo['ttft_s'] * 1e3:g}", "--slo-itl-ms", f"{slo['itl_s'] * 1e3:g}"]
        flags += ["--itl-target-ms", f"{itl_target_ms:g}"] if itl_target_ms else []
    return flags


# ---- loads ------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Traffic:
    """One class of requests: its shape and Poisson rate."""

    name: str
    input_len: int
    output_len: int
    rate: float


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    classes: tuple[Traffic, ...]


@dataclass(frozen=True)
class Workload:
    key: str
    phases: tuple[Phase, ...]
    rate: float | None = None  # a sweep point's rate

    def max_len(self) -> int:
        return max(t.input_len + t.output_len for p in self.phases for t in p.classes)


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the run's start
    phase: int
    traffic: Traffic
    prompt: list[int]


def plan(key: str, smoke: bool, rates: list[float], seconds_per_rate: float, rate_scale: float = 1.0) -> list[Workload]:
    """The workload's runs (one, or one per sweep rate); --smoke shrinks lengths 32x, rates 4x, times 60x (every
    class and phase still gets a request); `rate_scale` multiplies every rate (the four-GPU runs: the two-GPU loads
    per GPU)."""
    length, slower, shorter = (32, 4.0 / rate_scale, 60.0) if smoke else (1, 1.0 / rate_scale, 1.0)

    def cls(name: str, input_len: int, output_len: int, rate: float) -> Traffic:
        return Traffic(name, max(input_len // length, 4), max(output_len // length, 2), rate / slower)

    def one(name: str, seconds: float, *classes: Traffic) -> tuple[Phase, ...]:
        return (Phase(name, seconds / shorter, classes),)

    chat, doc = cls("chat", 512, 256, 10), cls("doc", 8192, 32, 1)
    if key == "mixed":
        return [Workload(key, one("mixed", 30, chat, doc))]
    if key == "prefill_heavy":
        return [Workload(key, one("prompts", 20, cls("prompt", 2048, 256, 16)))]
    if key == "decode_heavy":
        return [Workload(key, one("prompts", 30, cls("prompt", 256, 1024, 8)))]
    if key == "changing":
        return [Workload(key, (*one("chat", 60, chat), *one("documents", 60, replace(doc, rate=2 / slower))))]
    return [Workload(key, one(f"{r / slower:g}_rps", seconds_per_rate, cls("prompt", 2048, 256, r)), r / slower)
            for r in rates]


def arrivals(workload: Workload, seed: int, setup: Setup) -> list[Arrival]:
    """Poisson arrivals per class and phase, seeded by (seed, workload, rate, phase, class): equal across modes."""
    out, start = [], 0.0
    for p, phase in enumerate(workload.phases):
        for c, traffic in enumerate(phase.classes):
            rng = np.random.default_rng([seed, zlib.crc32(f"{workload.key}/{workload.rate}".encode()), p, c])
            times = np.cumsum(rng.exponential(1 / traffic.rate, int(traffic.rate * phase.seconds * 3) + 8))
            times = times[times < phase.seconds] if times[0] < phase.seconds else np.zeros(1)
            prompts = setup.prompts(len(times), traffic.input_len, seed=int(rng.integers(1 << 31)))
            out += [Arrival(start + float(t), p, traffic, ids) for t, ids in zip(times, prompts, strict=True)]
        start += phase.seconds
    return sorted(out, key=lambda a: a.at)


def warmup(workload: Workload, setup: Setup, per_class: int) -> list[Arrival]:
    classes = {t.name: t for p in workload.phases for t in p.classes}.values()
    return [Arrival(0.2 * i, 0, t, ids) for i, t in enumerate(classes)
            for ids in setup.prompts(per_class, t.input_len, seed=10_000 + i)]


# ---- the client and the pool poller -----------------------------------------------------------------------------
async def drive(url: str, load: list[Arrival], api_key: str) -> tuple[list[RequestResult], float, list[tuple]]:
    """Send `load` on schedule (kvflow bench serve's one_request) while polling /metrics: (results in load's
    order, seconds to the last completion, pool samples)."""
    headers = {"Authorization": f"Bearer {api_key}"}
    async with http_client() as client:
        model = (await client.get(f"{url}/v1/models", headers=headers)).json()["data"][0]["id"]
        start, done = time.perf_counter(), asyncio.Event()
        poller = asyncio.create_task(poll_pools(client, url, headers, start, done))

        async def send(a: Arrival) -> RequestResult:
            await asyncio.sleep(a.at - (time.perf_counter() - start))
            return await one_request(client, f"{url}/v1/completions", model, a.prompt, a.traffic.output_len, api_key)

        results = await asyncio.gather(*map(send, load))
        duration = time.perf_counter() - start
        done.set()
        return list(results), duration, await poller


async def poll_pools(client: httpx.AsyncClient, url: str, headers: dict[str, str], start: float,
                     done: asyncio.Event) -> list[tuple]:
    """(seconds, {worker: pool}, pool moves so far or None, {worker: [running, waiting]}, {"path/reason": count}),
    every POLL_S until `done`, once more after; (seconds, None, None, {}, {}) for a poll that failed."""
    samples: list[tuple] = []
    while True:
        last = done.is_set()
        try:
            response = await client.get(f"{url}/metrics", headers=headers, timeout=5.0)
            response.raise_for_status()
            samples.append((time.perf_counter() - start, *parse_pools(response.text)))
        except httpx.HTTPError:
            samples.append((time.perf_counter() - start, None, None, {}, {}))
        if last:
            return samples
        with contextlib.suppress(asyncio.TimeoutError):  # the next poll in POLL_S, or at once when the load is done
            await asyncio.wait_for(done.wait(), POLL_S)


def parse_pools(text: str) -> tuple[dict[str, str], float | None, dict[str, list[float]], dict[str, float]]:
    """From one /metrics page: each worker's pool, the planner's moves so far, each worker's [running, waiting]
    requests and the per-request prefill choices so far by path and reason."""
    from prometheus_client.parser import text_string_to_metric_families

    pools, moves, queues, decisions = {}, None, {}, {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "kvflow:worker_pool" and s.value == 1:
                pools[s.labels["worker"]] = s.labels["pool"]
            elif s.name == "kvflow:pool_moves_total":
                moves = (moves or 0.0) + s.value
            elif s.name in ("kvflow:worker_num_requests_running", "kvflow:worker_num_requests_waiting"):
                slot = 0 if s.name.endswith("running") else 1
                queues.setdefault(s.labels["worker"], [0.0, 0.0])[slot] = s.value
            elif s.name == "kvflow:prefill_path_decisions_total":
                decisions[f"{s.labels['path']}/{s.labels['reason']}"] = s.value
    return pools, moves, queues, decisions


def load_timeline(samples: list[tuple], load: list[Arrival], results: list[RequestResult],
                  bucket_s: float = 2.0) -> list[dict[str, Any]]:
    """Per `bucket_s` of arrival time: requests, their TTFT p50 / p90, and each worker's [running, waiting] at the
    bucket's first poll (how a backlog builds, and where)."""
    out = []
    for start in np.arange(0.0, max((a.at for a in load), default=0.0) + bucket_s, bucket_s):
        ttfts = [r.ttft_s for a, r in zip(load, results, strict=True) if r.ok and start <= a.at < start + bucket_s]
        polls = [s for s in samples if s[1] is not None and s[0] >= start]
        out.append({"t_s": float(start), "requests": len(ttfts),
                    "ttft_p50_s": round(float(np.percentile(ttfts, 50)), 3) if ttfts else None,
                    "ttft_p90_s": round(float(np.percentile(ttfts, 90)), 3) if ttfts else None,
                    "workers_running_waiting": polls[0][3] if polls else None})
    return out


def pool_record(samples: list[tuple], change_at: float | None) -> dict[str, Any]:
    """pool_moves (and, given the phase change, seconds_to_adapt and pool_timeline); None where no pools."""
    good = [s for s in samples if s[1] is not None]
    has_pools = any(sample[1] for sample in good)
    moves = [sample[2] for sample in good if sample[2] is not None]
    out: dict[str, Any] = {"pool_moves": moves[-1] - moves[0] if has_pools and moves else None,
                           "metrics_poll_failures": len(samples) - len(good)}
    if change_at is None:
        return out
    timeline = [{"t_s": round(sample[0], 2), "pools": sample[1]} for i, sample in enumerate(good)
                if i == 0 or sample[1] != good[i - 1][1]]
    changes = [e["t_s"] - change_at for e in timeline[1:] if e["t_s"] >= change_at]
    return {**out, "seconds_to_adapt": max(changes, default=0.0) if has_pools else None,
            "pool_timeline": timeline if has_pools else None}


# ---- metrics ----------------------------------------------------------------------------------------------------
def p99(values: list[float]) -> float | None:
    return float(np.percentile(values, 99)) if values else None


def meets(r: RequestResult, slo: dict[str, float]) -> bool:
    return r.ok and r.ttft_s <= slo["ttft_s"] and r.tpot_s <= slo["itl_s"]


def metrics(results: list[RequestResult], slo: dict[str, float]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    gaps = [g for r in ok for g in r.itl_s]
    return {"requests": len(results), "failed": len(results) - len(ok),
            "slo_attainment": sum(meets(r, slo) for r in results) / max(len(results), 1),
            "ttft_p99_s": p99([r.ttft_s for r in ok]), "itl_p99_s": p99(gaps), "itl_max_s": max(gaps, default=None),
            "tpot_p99_s": p99([r.tpot_s for r in ok if r.output_tokens > 1])}


def measure(url: str, api_key: str, workload: Workload, load: list[Arrival], slo: dict[str, float],
            head: dict[str, Any]) -> dict[str, Any]:
    results, duration, samples = asyncio.run(drive(url, load, api_key))
    pairs = list(zip(load, results, strict=True))
    classes = {a.traffic.name: a.traffic for a in load}
    record = {**head, "slo": slo, **metrics(results, slo),
              "out_tok_s": sum(r.output_tokens for r in results if r.ok) / duration, "seconds": duration,
              "errors": sorted({r.error for r in results if r.error})[:5],
              "classes": {name: {**asdict(t), **metrics([r for a, r in pairs if a.traffic.name == name], slo)}
                          for name, t in classes.items()},
              "phases": [{"name": ph.name, "seconds": ph.seconds,
                          **metrics([r for a, r in pairs if a.phase == i], slo)}
                         for i, ph in enumerate(workload.phases)],
              **pool_record(samples, workload.phases[0].seconds if workload.key == "changing" else None),
              "prefill_path_decisions": next((s[4] for s in reversed(samples) if s[1] is not None), {}),
              "load_timeline": load_timeline(samples, load, results)}
    return {**record, "request_rate": workload.rate} if workload.rate is not None else record


# ---- modes and runs ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bench:
    setup: Setup
    slo: dict[str, float]
    flags: dict[str, list[str]]  # mode -> kvflow serve flags
    seed: int
    warmup_per_class: int
    device: str
    api_key: str
    layout: str = "x2"  # a key of LAYOUTS
    rate_scale: float = 1.0

    @property
    def prefix(self) -> str:
        """Of the records' workload names and of the files: pd_adaptive_ (two GPUs), pd_adaptive_x4_ (four)."""
        return "pd_adaptive_" if self.layout == "x2" else f"pd_adaptive_{self.layout}_"

    def head(self, workload: Workload, mode: str) -> dict[str, Any]:
        return {"workload": f"{self.prefix}{workload.key}_{self.setup.model[1]}", "device": self.device, "mode": mode,
                "rate_scale": self.rate_scale, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}

    def start(self, mode: str, runs: list[Workload]) -> ServerProcess:
        """`mode`'s server for `runs`, started (not yet ready)."""
        smoke = self.setup.model == SMOKE_MODEL
        env = {k: os.environ.get(k, v) for k, v in MULTICAST_OFF.items()}
        return self.setup.serve("--max-model-len", str(max(w.max_len() for w in runs) + 64),
                                *(SMOKE_ENGINE if smoke else ()), "--api-key", self.api_key,
                                "--metrics-require-api-key", *self.flags[mode], env=env)

    def run_mode(self, mode: str, server: ServerProcess, runs: list[Workload]) -> Iterator[tuple[Workload, dict]]:
        """`runs` on `mode`'s server, then stop it: each run's record, or error records if it does not start."""
        try:
            server.wait_ready(300 if self.setup.model == SMOKE_MODEL else 600)
        except (RuntimeError, TimeoutError) as exc:
            server.stop()  # one that timed out still holds its devices
            log(f"mode {mode} did not start: {exc}")
            yield from ((w, {**self.head(w, mode), "error": f"did not start: {exc}"[-2000:]}) for w in runs)
            return
        warmed: set[str] = set()
        for w in runs:
            yield w, self.run_one(server.url, mode, w, warmed)

    def run_one(self, url: str, mode: str, workload: Workload, warmed: set[str]) -> dict[str, Any]:
        head = self.head(workload, mode)
        try:
            if workload.key not in warmed:  # a sweep's rates share one warm-up
                measure(url, self.api_key, workload, warmup(workload, self.setup, self.warmup_per_class), self.slo,
                        head)
                warmed.add(workload.key)
            record = measure(url, self.api_key, workload, arrivals(workload, self.seed, self.setup), self.slo, head)
        except Exception as exc:  # report it and go on: the lease is short
            log(f"{head['workload']} {mode} FAILED: {type(exc).__name__}: {exc}")
            return {**head, "error": f"{type(exc).__name__}: {exc}"}
        figures = {f"{c}.{k}": f"{v:.3g}" for c, m in [("all", record), *record["classes"].items()]
                   for k, v in m.items() if k in ("ttft_p99_s", "itl_p99_s", "itl_max_s") and v is not None}
        log(f"{head['workload']} {mode}{'' if workload.rate is None else f' @ {workload.rate:g} req/s'}: SLO {record['slo_attainment']:.3f}, out "
            f"{record['out_tok_s']:.0f} tok/s, failed {record['failed']}, pool moves {record['pool_moves']}; {figures}")
        return record


def run_group(bench: Bench, modes: list[str], runs: list[Workload],
              together: bool) -> Iterator[tuple[Workload, dict[str, Any]]]:
    """Every mode on `runs`, one mode at a time. `together` (--smoke) starts all modes' servers first: their
    start-ups overlap, and an idle server costs the measured one little (--smoke does not measure speed)."""
    with ExitStack() as stack:  # every server stopped, whatever happens
        started = {m: stack.enter_context(bench.start(m, runs)) for m in modes} if together else {}
        for mode in modes:
            server = started.get(mode) or stack.enter_context(bench.start(mode, runs))
            yield from bench.run_mode(mode, server, runs)
            if together:  # it stops while the next mode runs (the stack waits for it)
                server.process.send_signal(server.stop_signal)
            else:  # before the next mode's server starts on the same devices
                server.stop()


def file_records(path: Path) -> list[dict[str, Any]]:
    return json.loads(path.read_text())["records"] if path.exists() else []


def replace_record(records: list[dict[str, Any]], record: dict[str, Any]) -> list[dict[str, Any]]:
    """`records` with `record` in place of the file's earlier one of its workload, mode and sweep rate: a workload
    can be measured a mode per device call (records are dated), and a mode cut short by a call's limit keeps its
    old one."""

    def key(r: dict[str, Any]) -> tuple:
        return r.get("workload"), r["mode"], r.get("request_rate")

    return [r for r in records if key(r) != key(record)] + [record]


def commit() -> str:
    repo = Path(__file__).resolve().parents[1]
    done = subprocess.run(["git", "-C", str(repo), "describe", "--always", "--dirty"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


def context(bench: Bench, smoke: bool) -> dict[str, Any]:
    return {"device": bench.device, "commit": commit(), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "argv": sys.argv[1:], "model_flags": bench.setup.model, "mode_flags": bench.flags, "slo": bench.slo,
            "layout": bench.layout, "rate_scale": bench.rate_scale,
            "slo_rule": "met if completed, TTFT <= ttft_s and TPOT <= itl_s; attainment over requests sent",
            "servers": "one per mode for all workloads, all started up front" if smoke else "one per mode and workload",
            "warmup_per_class": bench.warmup_per_class, "seed": bench.seed, "metrics_poll_s": POLL_S,
            "load_average": os.getloadavg()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", nargs="+", choices=WORKLOADS, default=list(WORKLOADS))
    parser.add_argument("--layout", choices=tuple(LAYOUTS), default="x2",
                        help="x2: the two-GPU modes (pd_adaptive_*.json); x4: 2P2D, 1P3D, four replicas and "
                             "adaptive from 1P3D (pd_adaptive_x4_*.json)")
    parser.add_argument("--modes", nargs="+", choices=sorted({m for flags in LAYOUTS.values() for m in flags}),
                        default=None, help="default: every mode of --layout but the opt-in adaptive_dp2 / "
                                           "adaptive_dp4 (adaptive starting as replicas)")
    parser.add_argument("--rate-scale", type=float, default=1.0,
                        help="multiplies every workload's rate (e.g. 2 on four GPUs: the two-GPU load per GPU)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", RESULTS)))
    parser.add_argument("--rates", type=float, nargs="+", default=[12, 16, 20, 24])
    parser.add_argument("--seconds-per-rate", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="the servers' logs (default: a temporary folder); under $OUT they come back from a device")
    parser.add_argument("--itl-target-ms", type=float, default=None, help="adaptive's; default: serve's")
    parser.add_argument("--smoke", action="store_true", help="tiny model on CPU, seconds-long loads: the plumbing")
    args = parser.parse_args()
    layout_modes = LAYOUTS[args.layout]
    args.modes = args.modes or [m for m in layout_modes if m not in OPT_IN_MODES]
    if unknown := [m for m in args.modes if m not in layout_modes]:
        parser.error(f"--modes {' '.join(unknown)}: not a mode of --layout {args.layout} ({', '.join(layout_modes)})")
    if args.rate_scale <= 0:
        parser.error(f"--rate-scale must be > 0, got {args.rate_scale:g}")
    import torch

    args.rates = args.rates[:1] if args.smoke else args.rates
    slo = SMOKE_SLO if args.smoke else SLO
    gpus = torch.cuda.device_count()
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="pd-adaptive-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    bench = Bench(Setup(args.out, log_dir, SMOKE_MODEL if args.smoke else MODEL,
                        gpus >= 2),
                  slo, {m: mode_flags(m, slo, args.itl_target_ms, args.layout) for m in args.modes}, args.seed,
                  1 if args.smoke else 3, f"{gpus} x {device_name()}" if gpus > 1 else device_name(),
                  secrets.token_hex(8), args.layout, args.rate_scale)
    log(f"device {bench.device}; logs in {bench.setup.log_dir}")
    runs = {key: plan(key, args.smoke, args.rates, args.seconds_per_rate, args.rate_scale) for key in args.workloads}
    groups = [list(runs)] if args.smoke else [[key] for key in runs]
    files: dict[str, list[dict[str, Any]]] = {}
    for group in groups:
        for workload, record in run_group(bench, args.modes, [w for key in group for w in runs[key]], args.smoke):
            path = args.out / f"{bench.prefix}{'smoke' if args.smoke else workload.key}.json"
            files[path.name] = replace_record(files.get(path.name) or file_records(path), record)
            write_json(path, {"context": context(bench, args.smoke), "records": files[path.name]}, indent=1)
    return 1 if any("error" in r for records in files.values() for r in records if r["mode"] in args.modes) else 0


if __name__ == "__main__":
    sys.exit(main())
