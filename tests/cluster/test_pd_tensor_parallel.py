"""P/D between tensor-parallel workers on CPU (gloo links): each rank moves the KV heads it holds, rank to rank,
and a prefill TP that differs from the decode TP is re-sharded on the receive side.

Greedy outputs equal the unified TP1 engine's for TP2 -> TP2, TP2 -> TP1 and TP1 -> TP2 on the tiny Llama (2 KV
heads) and for TP2 -> TP1 / TP1 -> TP2 on SmolLM2 (3 KV heads: an uneven split); every block's bytes cross exactly
once (a replicated head from one rank only); a prefill rank killed mid-transfer is noticed within 2 s and the decode
side recomputes. Every gloo link, tensor-parallel ranks included, rendezvouses over the prefill worker's
authenticated KVLinkStore RPC (never a TCPStore), also between workers holding a cluster token.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from cluster.auth import TOKEN_ENV, ClusterAuth
from cluster.transfer.link.heads import assemble, plan_heads
from engine.kv_layout import KVSlice
from engine.kv_port import KVPort, KVRanks
from protos.kvflow.v1 import kvflow_pb2 as pb
from tests.helpers.pd import Worker, free_port, generate, metric, start_worker, wait_healthy, wait_until

TINY = ("--load-format", "dummy", "--max-model-len", "512", "--kv-cache-memory-bytes", str(8 << 20),
        "--kv-transfer-backend", "nccl")
# tiny: 2 layers x 2 KV heads x 16 dims, float32: one block's K and V over every layer
TINY_BLOCK_BYTES = 16 * 2 * 2 * 2 * 16 * 4
PAIRS = [(2, 2), (2, 1), (1, 2)]
TOKEN = "tensor-parallel-pd-token-0123456789"


def tiny_prompts(first: int) -> list[list[int]]:
    """Prompts of their own for each pair (the decode workers' prefix caches must not shorten a transfer)."""
    return [list(range(first, first + n)) for n in (5, 40, 300)]


PROMPTS = {pair: tiny_prompts(3 + 7 * i) for i, pair in enumerate(PAIRS)}
KILL_PROMPT = list(range(100, 400))
MAX_TOKENS = 12


# ---- the head plan (no processes) ----------------------------------------------------------------------------
def test_plan_pairs_each_decode_rank_with_the_ranks_holding_its_heads() -> None:
    smollm2_tp2, one_rank = ((0, 1), (2,)), ((0, 1, 2),)
    down = plan_heads(smollm2_tp2, one_rank)  # TP2 -> TP1: rank 0 gathers from both
    assert [(p.src, p.dst, p.heads) for p in down.pairs] == [(0, 0, (0, 1)), (1, 0, (2,))]
    assert down.export_heads(down.pairs[0]) is None and down.assembly(0) is None
    up = plan_heads(one_rank, smollm2_tp2)  # TP1 -> TP2: the one rank sends each decode rank its heads only
    assert [(p.src, p.dst, p.heads) for p in up.pairs] == [(0, 0, (0, 1)), (0, 1, (2,))]
    assert up.export_heads(up.pairs[1]) == (2,)


def test_replicated_heads_cross_once_per_receiving_rank() -> None:
    tp4 = ((0,), (0,), (1,), (1,))  # 2 KV heads over 4 ranks: each held twice
    down = plan_heads(tp4, ((0, 1),))
    assert [(p.src, p.dst, p.heads) for p in down.pairs] == [(0, 0, (0,)), (2, 0, (1,))]
    repeated = plan_heads(((0, 1),), ((0, 0), (1, 1)))  # a rank holding a head twice receives it once
    assert [(p.src, p.dst, p.heads) for p in repeated.pairs] == [(0, 0, (0,)), (0, 1, (1,))]
    assert repeated.assembly(0) == (0, 0)
    with pytest.raises(ValueError, match="no prefill rank holds"):
        plan_heads(((0,),), ((0, 1),))


def test_heads_exported_from_two_ranks_reassemble_into_one() -> None:
    """TP2 -> TP1 through KVPort: each prefill rank exports its heads, the decode rank imports them joined."""
    torch.manual_seed(0)
    full = [(torch.randn(6, 4, 3, 8), torch.randn(6, 4, 3, 8)) for _ in range(2)]
    shards = [[(k[:, :, list(heads)].clone(), v[:, :, list(heads)].clone()) for k, v in full]
              for heads in ((0, 1), (2,))]
    ranks = KVRanks(((0, 1), (2,)))
    sources = [KVPort(shard, "float32", ranks=ranks, rank=r) for r, shard in enumerate(shards)]
    target = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in full]
    sink = KVPort(target, "float32")
    plan = plan_heads(ranks.heads, sink.ranks.heads)
    part = KVSlice(0, 2, 0, 2)
    parts = [sources[p.src].export([4, 1], part, plan.export_heads(p)).tensor for p in plan.pairs]
    assert sum(t.nbytes for t in parts) == plan.total_bytes(sink.layout, part) == sink.layout.payload_bytes(2, 2)
    sink.import_([0, 5], part, assemble(parts, plan.assembly(0))).wait()
    for (k, v), (tk, tv) in zip(full, target, strict=True):
        assert torch.equal(tk[[0, 5]], k[[4, 1]]) and torch.equal(tv[[0, 5]], v[[4, 1]])


# ---- workers -------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_reference() -> dict[tuple[int, ...], list[int]]:
    from kvflow import LLM, SamplingParams

    llm = LLM("tiny", load_format="dummy", kv_cache_memory_bytes=8 << 20, max_model_len=512)
    prompts = [p for pair in PAIRS for p in PROMPTS[pair]] + [KILL_PROMPT, KILL_PROMPT[:200]]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))
    llm.close()
    return {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, outputs, strict=True)}


def _started(tmp: Path, specs: list[tuple[str, tuple[str, ...], str]]) -> list[Worker]:
    workers = [start_worker(role, tmp, *flags, model=model) for role, flags, model in specs]
    try:
        for worker in workers:
            wait_healthy(worker)
    except BaseException:
        for worker in workers:
            worker.stop()
        raise
    return workers


@pytest.fixture(scope="module")
def tiny_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Worker]]:
    """Prefill and decode workers of TP1 and TP2, shared by the module's tiny pairs."""
    tmp = tmp_path_factory.mktemp("pd_tp")
    names = ("prefill-tp1", "prefill-tp2", "decode-tp1", "decode-tp2")
    specs = [(name.split("-")[0], (*TINY, "--tensor-parallel-size", name[-1]), "tiny") for name in names]
    workers = _started(tmp, specs)
    yield dict(zip(names, workers, strict=True))
    for worker in workers:
        worker.stop()


def _gloo_bytes(worker: Worker) -> float:
    return metric(worker, "kvflow:kv_transfer_bytes_total", 'backend="gloo"')


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), PAIRS)
def test_tensor_parallel_pd_greedy_equals_unified_tp1(tiny_workers, tiny_reference, prefill_tp: int,  # noqa: ANN001
                                                      decode_tp: int) -> None:
    prefill, decode = tiny_workers[f"prefill-tp{prefill_tp}"], tiny_workers[f"decode-tp{decode_tp}"]
    before = _gloo_bytes(decode)
    prompts = PROMPTS[(prefill_tp, decode_tp)]

    async def run_all() -> list[pb.GenerateComplete]:  # concurrent pulls interleave their slices on one link
        return await asyncio.gather(*(asyncio.to_thread(generate, decode, p, prefill, MAX_TOKENS,
                                                        f"tp{prefill_tp}{decode_tp}-{i}")
                                      for i, p in enumerate(prompts)))

    for prompt, result in zip(prompts, asyncio.run(run_all()), strict=True):
        assert result.prefill_path == pb.PREFILL_PATH_DISAGGREGATED
        assert list(result.choices[0].token_ids) == tiny_reference[tuple(prompt)], f"prompt of {len(prompt)}"
    # Each block's every head crossed once (no head twice, none missing), whatever the two layouts.
    blocks = sum(-(-len(p) // 16) for p in prompts)
    wait_until(lambda: _gloo_bytes(decode) - before >= blocks * TINY_BLOCK_BYTES, 30.0, "the bytes counted")
    time.sleep(0.7)
    assert _gloo_bytes(decode) - before == blocks * TINY_BLOCK_BYTES


def test_workers_and_their_ranks_freeze_the_startup_heap(tiny_workers) -> None:  # noqa: ANN001
    """engine/process/gc_heap.py: the worker's server process once its engine is built, and each other
    tensor-parallel rank after its warm-up."""
    log = tiny_workers["decode-tp2"].log.read_text()
    assert "decode worker: " in log and "start-up objects frozen" in log, log[-3000:]
    assert "rank 1: " in log and log.count("start-up objects frozen") == 2, log[-3000:]


def test_tensor_parallel_gloo_links_rendezvous_over_the_authenticated_rpc_store(tiny_reference,  # noqa: ANN001
                                                                                tmp_path: Path) -> None:
    """TP2 -> TP2 between workers holding a cluster token (the prefill worker's from --cluster-token alone, so its
    ranks get it only from their worker, cluster/auth.py `env`): every rank's pair groups rendezvous over the
    prefill worker's KVLinkStore RPC, presenting it. A decode worker opening a link is told so (`rpc_store`, no
    TCPStore port: none is opened for gloo links), and a call without the token is refused."""
    from protos.kvflow.v1 import kvflow_pb2_grpc

    auth, port = ClusterAuth(TOKEN), free_port()
    tp2 = (*TINY, "--tensor-parallel-size", "2")
    prefill = start_worker("prefill", tmp_path, *tp2, "--cluster-token", TOKEN, port=port, model="tiny",
                           env={TOKEN_ENV: ""})
    decode = start_worker("decode", tmp_path, *tp2, "--prefill-allowlist", f"127.0.0.1:{port}", model="tiny",
                          env={TOKEN_ENV: TOKEN})
    try:
        for worker in (prefill, decode):
            wait_healthy(worker, auth=auth)
        prompt = PROMPTS[(2, 2)][0]
        result = generate(decode, prompt, prefill, MAX_TOKENS, "authenticated", auth=auth)
        assert result.prefill_path == pb.PREFILL_PATH_DISAGGREGATED
        assert list(result.choices[0].token_ids) == tiny_reference[tuple(prompt)]
        with auth.channel(prefill.address) as channel:
            stub = kvflow_pb2_grpc.PrefillStub(channel)
            layout = stub.Info(pb.InfoRequest(), timeout=10).kv_layout
            stream = stub.KVLink(pb.KVLinkRequest(link_id="probe-link", decode_worker_id="test", layout=layout,
                                                  backend=pb.KV_TRANSFER_BACKEND_GLOO), timeout=20)
            ready = next(iter(stream)).ready
            stream.cancel()
        assert ready.rpc_store, ready
        assert len(ready.rank_heads) == 2
        with ClusterAuth().channel(prefill.address) as channel, pytest.raises(grpc.RpcError) as caught:
            kvflow_pb2_grpc.PrefillStub(channel).KVLinkStore(
                pb.KVLinkStoreRequest(link_id="probe-link", op=pb.KV_LINK_STORE_OP_NUM_KEYS), timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        prefill.stop()
        decode.stop()


@pytest.fixture(scope="module")
def smollm2_workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Worker]]:
    tmp = tmp_path_factory.mktemp("pd_tp_smollm2")
    names = ("prefill-tp1", "prefill-tp2", "decode-tp1", "decode-tp2")
    flags = ("--kv-transfer-backend", "nccl", "--kv-cache-memory-bytes", str(128 << 20), "--max-model-len", "2048")
    workers = _started(tmp, [(name.split("-")[0], (*flags, "--tensor-parallel-size", name[-1]), "smollm2")
                             for name in names])
    yield dict(zip(names, workers, strict=True))
    for worker in workers:
        worker.stop()


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "prompts"), [(2, 2, slice(0, 3)), (2, 1, slice(3, 6)),
                                                                   (1, 2, slice(6, 11))])
def test_smollm2_uneven_heads_pd_greedy_equals_unified(smollm2_workers, prompt_sets, unified,  # noqa: ANN001
                                                       prefill_tp: int, decode_tp: int, prompts: slice) -> None:
    """SmolLM2's 3 KV heads split 2 + 1 at TP2: TP2 -> TP1 joins them, TP1 -> TP2 splits them."""
    prefill, decode = smollm2_workers[f"prefill-tp{prefill_tp}"], smollm2_workers[f"decode-tp{decode_tp}"]
    chosen = (prompt_sets["short"] + prompt_sets["long"][:1])[prompts]

    async def run_all() -> list[pb.GenerateComplete]:
        return await asyncio.gather(*(asyncio.to_thread(generate, decode, p, prefill) for p in chosen))

    for prompt, result in zip(chosen, asyncio.run(run_all()), strict=True):
        assert result.prefill_path == pb.PREFILL_PATH_DISAGGREGATED
        assert list(result.choices[0].token_ids) == unified[tuple(prompt)], f"prompt of {len(prompt)} tokens"


def test_grpc_backend_is_refused_for_tensor_parallel_workers(tiny_workers) -> None:  # noqa: ANN001
    from cluster.transfer.registry import build_receiver

    ranks = KVRanks(((0,), (1,)))
    port = KVPort([(torch.zeros(2, 16, 1, 16), torch.zeros(2, 16, 1, 16))], "float32", ranks=ranks)
    with pytest.raises(ValueError, match="tensor-parallel workers move KV rank to rank"):
        build_receiver("grpc", port, "w", None)  # type: ignore[arg-type]


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def test_abort_mid_transfer_keeps_the_tensor_parallel_link(tiny_workers, tiny_reference,  # noqa: ANN001
                                                          tmp_path: Path) -> None:
    """An aborted pull's slices still reach every decode rank (dropped there, so the pairs stay paired); the next
    pull over the same link is exact."""
    from tests.helpers.pd import abort_mid_transfer, info

    slow = ("--max-num-batched-tokens", "16")
    [prefill] = _started(tmp_path, [("prefill", (*TINY, "--tensor-parallel-size", "2", *slow), "tiny")])
    decode = tiny_workers["decode-tp2"]
    try:
        baseline = info(prefill).num_free_kv_blocks
        finish_reason = abort_mid_transfer(decode, prefill, list(range(50, 450)), baseline, 30.0)
        assert finish_reason == pb.FINISH_REASON_ABORT
        wait_until(lambda: info(prefill).num_free_kv_blocks == baseline, 12.0, "prefill blocks back")
        prompt = KILL_PROMPT[:200]
        again = generate(decode, prompt, prefill, MAX_TOKENS, "after-abort")
        assert again.prefill_path == pb.PREFILL_PATH_DISAGGREGATED
        assert list(again.choices[0].token_ids) == tiny_reference[tuple(prompt)]
        assert prefill.log.read_text().count("KV link ") == 1, "the link was kept"
    finally:
        prefill.stop()


def test_prefill_rank_killed_mid_transfer_is_noticed_and_decode_recomputes(
        tiny_workers, tiny_reference, tmp_path: Path) -> None:  # noqa: ANN001
    """A TP2 prefill worker whose rank 1 dies mid-transfer: the TP2 decode worker notices within 2 s and answers
    from a local prefill, equal to the unified engine."""
    slow = ("--max-num-batched-tokens", "16")  # the 300-token prompt takes ~19 steps: time to kill mid-transfer
    [prefill] = _started(tmp_path, [("prefill", (*TINY, "--tensor-parallel-size", "2", *slow), "tiny")])
    decode = tiny_workers["decode-tp2"]
    try:
        prompt = KILL_PROMPT
        before = metric(decode, "kvflow:disagg_fallback_total")

        async def kill_mid_transfer() -> tuple[pb.GenerateComplete, float]:
            call = asyncio.ensure_future(asyncio.to_thread(generate, decode, prompt, prefill, MAX_TOKENS, "kill"))
            # The link opens with this pull (a new prefill worker); its prefill then takes ~19 steps of 16 tokens.
            await asyncio.to_thread(wait_until, lambda: "KV link" in prefill.log.read_text(), 30.0, "the link")
            killed = time.monotonic()
            os.kill(_children(prefill.process.pid)[0], signal.SIGKILL)
            return await call, killed

        result, killed = asyncio.run(kill_mid_transfer())
        assert time.monotonic() - killed < 5, "noticed and recomputed"
        assert result.prefill_path == pb.PREFILL_PATH_LOCAL
        assert list(result.choices[0].token_ids) == tiny_reference[tuple(prompt)]
        assert metric(decode, "kvflow:disagg_fallback_total") > before
        log = "".join(w.log.read_text() for w in (decode,))
        assert "is down" in log
    finally:
        prefill.stop()
    # the decode worker keeps serving disaggregated requests with a healthy prefill worker
    again = [t + 1 for t in KILL_PROMPT[:40]]  # not cached on the decode side
    result = generate(decode, again, tiny_workers["prefill-tp2"], MAX_TOKENS, "after")
    assert result.prefill_path == pb.PREFILL_PATH_DISAGGREGATED


def test_kvflow_serve_disaggregates_a_tp2_prefill_worker_into_a_tp1_decode_worker(tmp_path: Path) -> None:
    """`--tensor-parallel-size 2` applies to both roles and `--decode-tensor-parallel-size 1` overrides it: no
    refusal, and a completion takes the P/D path (auto is the link between TP workers) with the unified result."""
    import httpx

    from cluster.auth import TOKEN_ENV
    from kvflow.launcher import free_port
    from tests.helpers.serve import wait_healthy as serve_healthy

    port, log = free_port(), tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvflow.cli", "serve", "--model", "tiny", "--load-format", "dummy",
             "--max-model-len", "512", "--kv-cache-memory-bytes", str(8 << 20), "--port", str(port),
             "--grpc-port", str(free_port()), "--disagg-policy", "static", "--disagg-min-prompt-tokens", "1",
             "--tensor-parallel-size", "2", "--decode-tensor-parallel-size", "1"],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        serve_healthy(process, url, log)
        prompt = PROMPTS[(2, 1)][1]
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
        served = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
        from kvflow import LLM, SamplingParams

        llm = LLM("tiny", load_format="dummy", kv_cache_memory_bytes=8 << 20, max_model_len=512)
        [reference] = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0,
                                                                                  max_tokens=MAX_TOKENS))
        llm.close()
        assert served["choices"][0]["text"] == reference.outputs[0].text
        metrics = httpx.get(f"{url}/metrics", timeout=10).text
        assert 'kvflow:requests_total{path="disaggregated"} 1.0' in metrics, log.read_text()[-3000:]
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


def test_decode_rank_killed_mid_transfer_ends_the_link_and_frees_prefill_blocks(tmp_path: Path) -> None:
    """A TP2 decode worker whose rank 1 dies mid-pull: the prefill worker's link to it ends within 2 s, its held
    blocks come back, and the decode worker stops (a TP engine cannot step without a rank; its supervisor
    restarts it)."""
    from tests.helpers.pd import info

    slow = ("--max-num-batched-tokens", "16")
    prefill, doomed = _started(tmp_path, [("prefill", (*TINY, "--tensor-parallel-size", "2", *slow), "tiny"),
                                          ("decode", (*TINY, "--tensor-parallel-size", "2"), "tiny")])
    try:
        baseline = info(prefill).num_free_kv_blocks
        request = threading.Thread(target=_try_generate, args=(doomed, prefill))
        request.start()
        wait_until(lambda: info(prefill).num_free_kv_blocks < baseline, 30.0, "the prefill to hold blocks")
        killed = time.monotonic()
        os.kill(_children(doomed.process.pid)[0], signal.SIGKILL)
        wait_until(lambda: " closed (" in prefill.log.read_text(), 2.0, "the prefill side to end the link")
        noticed = time.monotonic() - killed
        wait_until(lambda: info(prefill).num_free_kv_blocks == baseline, 12.0, "prefill blocks back")
        assert doomed.process.wait(60) != 0
        assert noticed < 2.0
        request.join(30)
    finally:
        prefill.stop()
        doomed.stop()


def _try_generate(decode: Worker, prefill: Worker) -> bool:
    """One disaggregated request that may fail (its decode worker is being killed)."""
    try:
        generate(decode, list(range(150, 450)), prefill, MAX_TOKENS, "doomed")
    except Exception:  # noqa: BLE001 - the worker dies under it
        return False
    return True
