"""CPU checks of the engine's CUDA path: graph capture sizes, backend selection, the Triton backend's metadata,
and the Triton backend + fused layer ops against the torch path (through Triton's interpreter).

The GPU itself was exercised by bench/gpu_bench.py (retired: git checkout efcd5a5) on a lent machine (CI has
no GPU). As in test_kernels.py, TRITON_INTERPRET=1 must be set before `import triton`, so the interpreter checks
run in a subprocess that re-runs this file with it set (tests/helpers/interpreter.py).
"""

from __future__ import annotations

import copy

import pytest
import torch

from engine.arg_utils import EngineArgs
from engine.llm_engine import LLMEngine
from engine.models.llama import CausalLM, SmallGemmMode
from engine.models.registry import model_class
from engine.runner.attention import AttentionBatch, TorchPagedAttention
from engine.runner.attention_triton import TritonPagedAttention, num_leading_decodes
from engine.runner.cuda_graphs import DecodeResult, capture_sizes, default_capture_sizes, padded_size
from engine.runner.model_runner import ModelRunner, select_attention_backend
from engine.sampling_params import SamplingParams
from kernels.small_gemm import GemvConfig
from tests.helpers.interpreter import interpreter_cases_test

interp = pytest.mark.triton_interpreter  # collected only under TRITON_INTERPRET=1 (tests/conftest.py)
plain = pytest.mark.outside_interpreter


@plain
def test_default_capture_sizes_follow_vllm() -> None:
    assert default_capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert default_capture_sizes(4096)[-1] == 512 and len(default_capture_sizes(4096)) == 3 + 64
    assert default_capture_sizes(12) == [1, 2, 4, 8, 12]  # max_num_seqs itself is always covered
    assert default_capture_sizes(3) == [1, 2, 3]
    assert default_capture_sizes(1) == [1]


@plain
def test_capture_sizes_override_and_enforce_eager() -> None:
    assert capture_sizes(256, None, enforce_eager=True) == []
    assert capture_sizes(256, (4, 1, 2, 4), enforce_eager=True) == []
    assert capture_sizes(16, (64, 4, 1, 2, 4), enforce_eager=False) == [1, 2, 4]
    assert capture_sizes(8, (32, 16), enforce_eager=False) == [16]  # the smallest still pads every batch
    with pytest.raises(ValueError, match="positive"):
        capture_sizes(8, (0, 4), enforce_eager=False)


@plain
def test_padded_size_picks_next_captured_size() -> None:
    sizes = [1, 2, 4, 8, 16]
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]
    assert padded_size(17, sizes) is None


@plain
def test_backend_selection_by_device() -> None:
    assert isinstance(select_attention_backend(torch.device("cpu"), 16), TorchPagedAttention)
    assert isinstance(select_attention_backend(torch.device("cuda"), 16), TritonPagedAttention)  # no CUDA call


@plain
def test_cpu_runner_keeps_the_torch_path() -> None:
    config = EngineArgs(model="tiny", load_format="dummy", device="cpu", kv_cache_memory_bytes=1 << 20,
                        max_model_len=256).create_engine_config()
    runner = ModelRunner(config)
    assert isinstance(runner.attn_backend, TorchPagedAttention)
    assert runner.graph_sizes == [] and runner.graphs is None
    assert not any(getattr(m, "fused", False) for m in runner.model.modules())
    assert runner.model.embed_tokens.weight.dtype == torch.float32


def _mixed_batch() -> AttentionBatch:
    # Block size 4. Two decodes (contexts 5 and 11), an extend of 3 tokens on a 4-token prefix, then a fresh
    # 6-token prefill whose table lists one block more than its context needs.
    return AttentionBatch(query_lens=[1, 1, 3, 6], seq_lens=[5, 11, 7, 6],
                          block_tables=[[3, 9], [4, 5, 6], [7, 8], [10, 11, 12]],
                          slot_mapping=[36, 26, 32, 33, 34, 40, 41, 42, 43, 44, 45])


@plain
def test_triton_metadata_splits_decode_run_and_prefill() -> None:
    meta = TritonPagedAttention(block_size=4).build_metadata(_mixed_batch(), torch.device("cpu"))
    assert meta.num_decode_tokens == 2 and meta.decode_max_seq_len == 11 and meta.prefill_max_q_len == 6
    assert meta.decode_seq_lens is not None and meta.decode_seq_lens.tolist() == [5, 11]
    assert meta.decode_block_tables is not None and meta.prefill_block_tables is not None
    # Tables hold only the blocks of each context (a table may list more), zero-padded to 16 columns.
    assert meta.decode_block_tables.tolist() == [[3, 9] + [0] * 14, [4, 5, 6] + [0] * 13]
    assert meta.prefill_block_tables.tolist() == [[7, 8] + [0] * 14, [10, 11] + [0] * 14]
    # Every int32 slice starts on 16 bytes and every table row stride is a multiple of 16 (no new Triton
    # specialization per batch make-up)
    for t in (meta.decode_seq_lens, meta.decode_block_tables, meta.prefill_block_tables, meta.prefill_cu_seqlens_q,
              meta.prefill_seq_lens):
        assert t.data_ptr() % 16 == 0
    assert meta.decode_block_tables.stride(0) % 16 == 0 and meta.prefill_block_tables.stride(0) % 16 == 0
    assert meta.prefill_cu_seqlens_q is not None and meta.prefill_cu_seqlens_q.tolist() == [0, 3, 9]
    assert meta.prefill_seq_lens is not None and meta.prefill_seq_lens.tolist() == [7, 6]
    assert meta.decode_block_tables.dtype == torch.int32 and meta.slot_mapping.dtype == torch.int64
    assert num_leading_decodes([3, 1, 1]) == 0 and num_leading_decodes([1, 1]) == 2


# This module's `interp` cases, run in a TRITON_INTERPRET=1 subprocess (tests/helpers/interpreter.py).
test_triton_and_fused_ops_match_torch_under_interpreter = interpreter_cases_test(__file__, at_least=3, at_most=3,
                                                                                 timeout=600)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@interp
def test_triton_backend_matches_torch_backend() -> None:
    """Random caches and q/k/v: same outputs and the same cache writes, for a decode+extend+prefill batch."""
    g = torch.Generator().manual_seed(0)
    batch = _mixed_batch()
    num_tokens, heads, kv_heads, dim = len(batch.slot_mapping), 4, 2, 16
    caches = tuple(torch.randn(13, 4, kv_heads, dim, generator=g) for _ in range(2))
    q = torch.randn(num_tokens, heads, dim, generator=g)
    k, v = (torch.randn(num_tokens, kv_heads, dim, generator=g) for _ in range(2))
    torch_caches = tuple(c.clone() for c in caches)
    triton_caches = tuple(c.clone() for c in caches)
    cpu = torch.device("cpu")
    ref = TorchPagedAttention(4)
    out_ref = ref.forward(q, k, v, torch_caches, ref.build_metadata(batch, cpu), 0.25)
    tri = TritonPagedAttention(4)
    out = tri.forward(q, k, v, triton_caches, tri.build_metadata(batch, cpu), 0.25)
    assert _rel(out, out_ref) < 1e-5
    for mine, theirs in zip(triton_caches, torch_caches, strict=True):
        assert torch.equal(mine, theirs)


@interp
def test_fused_model_matches_torch_model() -> None:
    """The CUDA path's model (Triton backend, fused norm/rotary/SwiGLU) against the CPU path, fp32: a prefill
    step, then a step mixing two decodes with an extend."""
    for preset in ("tiny-llama", "tiny-qwen3", "tiny-qwen3-moe"):  # qwen3: q/k norms on [T, H, D] views; MoE
        config = EngineArgs(model=preset, load_format="dummy").create_engine_config()
        arch, hf = config.model.arch, config.model.hf_config
        model = model_class(arch.architecture)
        torch.manual_seed(0)
        ref_model = model(arch, hf, TorchPagedAttention(4), 64)
        ref_model.init_dummy_weights(0)
        fused_model = model(arch, hf, TritonPagedAttention(4), 64, fused_ops=True)
        fused_model.load_state_dict(copy.deepcopy(ref_model.state_dict()))
        fused_model.prepare_fused_weights()  # an MoE model's experts run as kernels/fused_moe.py
        shape = (16, 4, arch.num_kv_heads, arch.head_dim)
        caches = {name: [(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_layers)]
                  for name in ("ref", "fused")}
        g = torch.Generator().manual_seed(1)
        steps = [
            AttentionBatch([7, 9], [7, 9], [[1, 2], [3, 4, 5]], [4, 5, 6, 7, 8, 9, 10] + list(range(12, 21))),
            AttentionBatch([1, 1, 4], [8, 10, 4], [[1, 2], [3, 4, 5], [6]], [11, 21, 24, 25, 26, 27]),
        ]
        positions = [list(range(7)) + list(range(9)), [7, 9, 0, 1, 2, 3]]
        for batch, pos in zip(steps, positions, strict=True):
            ids = torch.randint(0, arch.vocab_size, (len(pos),), generator=g)
            pos_t = torch.as_tensor(pos)
            with torch.inference_mode():
                out_ref = ref_model(ids, pos_t, caches["ref"],
                                    ref_model.layers[0].self_attn.backend.build_metadata(batch, torch.device("cpu")))
                out = fused_model(ids, pos_t, caches["fused"],
                                  fused_model.layers[0].self_attn.backend.build_metadata(batch, torch.device("cpu")))
            assert _rel(out, out_ref) < 1e-5, (preset, _rel(out, out_ref))


VARIANTS = (SmallGemmMode(True, 1 << 30, True, "gemv"), SmallGemmMode(True, 1 << 30, True, "dot"),
            SmallGemmMode(True, 0, False, "gemv"),
            SmallGemmMode(True, 1 << 30, True, "gemv", GemvConfig(block_n=16, block_k=16, pipelined=True, prefetch=True)),
            None)  # fused prologues, the same on tensor cores, none, pipelined GEMV loads over K tiles (4 to 8 of them;
# 16-row programs: a quarter of the interpreter's program launches of the default 4 rows); None: off


@interp
def test_small_batch_gemm_layers_match_the_unfused_layers() -> None:
    """bf16, single-token steps: the layers through kernels/small_gemm.py (norm + qkv with bias for qwen2,
    o, norm + gate|up, SwiGLU + down; float32 logits with the argmax fused) against the same fused model with
    them switched off (norm/SwiGLU kernels + torch linears). The interpreter rounds bf16 its own way, so the
    comparison is within bf16 tolerance; the fused argmax must be the argmax of the logits it returned. The MoE
    model's layers take the attention GEMVs, then its own block (router GEMV, routing kernel, expert GEMVs): the
    default mode against none (the other modes vary only the dense kernels, which the dense presets cover)."""
    for preset in ("tiny-llama", "tiny-qwen2", "tiny-qwen3-moe"):
        config = EngineArgs(model=preset, load_format="dummy").create_engine_config()
        arch, hf = config.model.arch, config.model.hf_config
        models = {}
        for variant in VARIANTS if arch.moe is None else (VARIANTS[0], None):
            model = model_class(arch.architecture)(arch, hf, TritonPagedAttention(4), 64, fused_ops=True)
            model.init_dummy_weights(0)
            model.to(torch.bfloat16)
            model.prepare_fused_weights()
            for module in [model, *model.layers]:
                module.small_gemm = variant is not None
                module.small_gemm_mode = variant or SmallGemmMode()
            models[variant] = model
        shape = (16, 4, arch.num_kv_heads, arch.head_dim)
        caches = {v: [(torch.zeros(shape, dtype=torch.bfloat16), torch.zeros(shape, dtype=torch.bfloat16))
                      for _ in range(arch.num_layers)] for v in models}
        g = torch.Generator().manual_seed(1)
        steps = [AttentionBatch([7], [7], [[1, 2]], [4, 5, 6, 7, 8, 9, 10]),  # prefill: the unfused layers
                 AttentionBatch([1], [8], [[1, 2]], [11]), AttentionBatch([1], [9], [[1, 2, 3]], [12])]
        positions = [list(range(7)), [7], [8]]
        for batch, pos in zip(steps, positions, strict=True):
            ids = torch.randint(0, arch.vocab_size, (len(pos),), generator=g)
            outs = {}
            for variant, model in models.items():
                meta = model.layers[0].self_attn.backend.build_metadata(batch, torch.device("cpu"))
                with torch.inference_mode():
                    hidden = model(ids, torch.as_tensor(pos), caches[variant], meta)
                    logits, tokens = model.compute_logits_argmax(
                        hidden, torch.full((len(pos), arch.vocab_size), float("nan")))
                assert torch.equal(tokens, logits.argmax(dim=-1))
                outs[variant] = (hidden, logits)
            for variant in [v for v in models if v is not None]:
                for i in (0, 1):  # hidden states, logits
                    assert _rel(outs[variant][i], outs[None][i]) < 3e-2, (preset, variant, i)


class EagerDecodeGraphs:
    """DecodeGraphs' interface run eagerly on the CPU runner's own model and cache, so the runner's decode-graph
    path (lm_head + argmax in the replay, decode-ahead) is exercised without a GPU. The ahead step runs at queue
    time, so its KV write lands before the next real step, as on the GPU stream."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.sizes = [1, 2, 4, 8]
        self.replays = 0
        self.last: list[int] = []

    def can_run(self, num_seqs: int, max_seq_len: int) -> bool:
        return num_seqs <= self.sizes[-1] and max_seq_len <= 200

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            block_tables: list[list[int]]) -> DecodeResult:
        return self._forward(torch.as_tensor(input_ids), positions, slots, seq_lens, block_tables)

    def run_ahead(self, input_ids: torch.Tensor, positions: list[int], slots: list[int], seq_lens: list[int],
                  block_tables: list[list[int]]) -> DecodeResult:
        return self._forward(input_ids.clone(), positions, slots, seq_lens, block_tables)

    def _forward(self, ids: torch.Tensor, positions: list[int], slots: list[int], seq_lens: list[int],
                 block_tables: list[list[int]]) -> DecodeResult:
        runner = self.runner
        self.replays += 1
        meta = runner.attn_backend.build_metadata(
            AttentionBatch([1] * len(ids), seq_lens, block_tables, slots), runner.device)
        with torch.inference_mode():
            hidden = runner.model(ids, torch.as_tensor(positions), runner.kv_caches, meta)
            logits = runner.model.compute_logits(hidden)
        return DecodeResult(logits, logits.argmax(dim=-1))

    def tokens_to_host(self, tokens: torch.Tensor) -> None:
        self.last = tokens.tolist()

    def host_tokens(self, n: int) -> list[int]:
        return self.last[:n]


def _run_engine(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    ids = [engine.add_request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params, strict=True))]
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = list(out.outputs[0].token_ids)
    return {i: done[i] for i in ids} if ids else done  # no new requests: whatever was already running


@plain
def test_compute_logits_into_a_shared_buffer() -> None:
    """The decode graphs write logits into prefixes of one buffer: same values as a fresh tensor."""
    config = EngineArgs(model="tiny", load_format="dummy", device="cpu").create_engine_config()
    model = CausalLM(config.model.arch, config.model.hf_config, TorchPagedAttention(4), 64)
    model.init_dummy_weights(0)
    hidden = torch.randn(3, config.model.arch.hidden_size)
    buf = torch.full((5, config.model.arch.vocab_size), float("nan"))
    with torch.inference_mode():
        out = model.compute_logits(hidden, out=buf[:3])
        assert out.data_ptr() == buf.data_ptr() and torch.equal(out, model.compute_logits(hidden))
        bf16 = model.to(torch.bfloat16)  # the cast into the float32 buffer is the same exact widening
        assert torch.equal(bf16.compute_logits(hidden.bfloat16(), out=buf[:3]), bf16.compute_logits(hidden.bfloat16()))


@plain
def test_decode_graph_path_and_decode_ahead_keep_outputs() -> None:
    """The runner's graph path with decode-ahead gives the same tokens as the plain CPU path: greedy requests
    (ahead replays used, finishing by length and by stop token, block boundaries with block size 4), a request
    joining mid-run (the ahead replay is dropped), sampled ones (seeded with penalties and logprobs, unseeded),
    ahead replays used for them too, and a stop-token finish beside running rows (the replay's other rows used)."""
    def engine(fake: bool) -> LLMEngine:
        eng = LLMEngine(EngineArgs(model="tiny", load_format="dummy", device="cpu", kv_cache_memory_bytes=1 << 22,
                                   max_model_len=256, block_size=4, seed=0).create_engine_config())
        if fake:
            eng.runner.graphs = EagerDecodeGraphs(eng.runner)  # type: ignore[assignment]
        return eng

    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 200, (n,), generator=g).tolist() for n in (5, 9, 3, 12)]
    greedy = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (23, 17, 30, 9)]
    base, fake = engine(False), engine(True)
    stop_at = _run_engine(base, prompts[:1], greedy[:1])["r0"][6]
    cases = [
        (prompts, greedy),
        (prompts[:2], [SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_at]), greedy[1]]),
        (prompts[:3], [greedy[0], SamplingParams(temperature=0.8, seed=3, max_tokens=12, repetition_penalty=1.2,
                                                 logprobs=2), greedy[2]]),
    ]
    for prompts_i, params_i in cases:
        assert _run_engine(fake, prompts_i, params_i) == _run_engine(base, prompts_i, params_i)
    ahead = fake.runner.decode_ahead
    assert ahead.partial_hits >= 1  # case 2: r0 stopped beside r1, whose row of the queued replay was used
    hits = ahead.hits
    sampled = [SamplingParams(temperature=1.0, max_tokens=m, ignore_eos=True) for m in (20, 14, 25)]
    assert _run_engine(fake, prompts[:3], sampled) == _run_engine(base, prompts[:3], sampled)
    assert ahead.hits >= hits + 10  # sampled batches queue ahead as greedy ones do
    # One request alone, then a second joins while the first decodes: the ahead replay is dropped, not used.
    solo = [_run_engine(eng, prompts[2:3], greedy[2:3]) for eng in (base, fake)]
    assert solo[0] == solo[1]
    runner = fake.runner
    misses = runner.decode_ahead.misses
    assert runner.decode_ahead.hits > 20 and misses == 0  # the stop-token finish left r1's row to be used
    for eng in (base, fake):
        eng.add_request("a", prompts[0], greedy[2])
        for _ in range(6):
            eng.step()
        eng.add_request("b", prompts[1], greedy[1])
    outs = [_run_engine(eng, [], []) for eng in (base, fake)]
    assert set(outs[0]) == {"a", "b"} and outs[0] == outs[1]
    assert runner.decode_ahead.misses > misses


@plain
def test_tensor_parallel_ranks_queue_no_replay_for_a_constrained_row() -> None:
    """Only rank 0 holds a grammar's matcher, so another rank's ids for that row may differ from rank 0's; every
    rank knows the row is constrained and none queues a replay (their collectives keep pairing). A single rank
    queues it."""
    from engine.outputs import NewRequestData, ScheduledChunk
    from engine.runner.decode_ahead import DecodeAhead
    from engine.runner.input_batch import RunnerRequestState
    from engine.structured.grammar import StructuredOutputsParams

    guided = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(regex="a+"))
    new = NewRequestData("r", [1, 2, 3], guided)
    follower = RunnerRequestState.from_new(new, torch.device("cpu"), None, leader=False)
    assert follower.matcher is None and follower.constrained and not follower.plain_greedy
    with pytest.raises(RuntimeError, match="StructuredOutputManager"):  # rank 0 must hold the matcher
        RunnerRequestState.from_new(new, torch.device("cpu"), None)

    class Graphs:
        def can_run(self, num_seqs: int, max_seq_len: int) -> bool:
            return True

        def run_ahead(self, *args: object) -> DecodeResult:
            return DecodeResult(torch.zeros(1, 4), torch.zeros(1, dtype=torch.int64))

    chunk = ScheduledChunk("r", [7], 3, [0, 1], sample=True, prompt_logprobs=False)
    for tensor_parallel, queued in ((True, False), (False, True)):
        ahead = DecodeAhead(block_size=4, max_model_len=64, tensor_parallel=tensor_parallel)
        ahead.queue([chunk], [3], [follower], torch.tensor([5]), Graphs())  # type: ignore[arg-type]
        assert (ahead.pending is not None) == queued
