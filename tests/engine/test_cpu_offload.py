"""--cpu-offload-gb (engine/runner/weight_offload.py): the layer plan for a byte budget, the streamed model's logits against
the resident model's (bit-identical, on CPU: host copies and the staging buffer are both CPU tensors there), the
flag on every command, and the refusals (CPU device, negative, tensor parallelism, quantization).

The CUDA path (pinned host memory, copies captured in the decode graphs) is checked by the last test when a GPU is
present, and measured by bench/offload_gpu.py (retired: it runs at git checkout 889a256).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.arg_utils import EngineArgs
from engine.config import GiB
from engine.models.llama import CausalLM, DecoderLayer
from engine.models.presets import preset_hf_config
from engine.runner.attention import AttentionBatch, KVCache, TorchPagedAttention
from engine.runner.weight_offload import LayerWeightStream, parameter_bytes, plan_offload
from kvflow.cli import build_parser, main
from kvflow.commands.flag_compat import prepare_argv
from kvflow.launcher import engine_argv

CPU = torch.device("cpu")
BLOCK = 4


def test_plan_offloads_whole_leading_layers_until_the_budget_is_reached() -> None:
    layer = 1000
    assert plan_offload(0, layer, 8).num_layers == 0
    assert plan_offload(1, layer, 8).num_layers == 1  # vLLM offloads until its total reaches the budget
    assert plan_offload(2000, layer, 8).num_layers == 2
    assert plan_offload(2001, layer, 8).num_layers == 3
    assert plan_offload(10**9, layer, 8).num_layers == 8  # more than the model: every layer
    plan = plan_offload(2500, layer, 8)
    assert (plan.offloaded_bytes, plan.staging_bytes, plan.gpu_bytes_saved) == (3000, 2000, 1000)  # 2 buffers
    assert plan_offload(0, layer, 8).staging_bytes == 0
    assert plan_offload(1, layer, 8).staging_bytes == 1000  # one layer: one buffer
    with pytest.raises(ValueError, match="cpu_offload_gb must be >= 0"):
        plan_offload(-1, layer, 8)


def test_llama_8b_layer_bytes_and_plans() -> None:
    """Llama-3.1-8B in bf16 (a layer built on the meta device, as the runner sizes it): 218.1M parameters a layer."""
    arch = EngineArgs(model="llama-3.1-8b", load_format="dummy").create_engine_config().model.arch
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            layer_bytes = parameter_bytes(DecoderLayer(arch, TorchPagedAttention(16)))
    finally:
        torch.set_default_dtype(previous)
    assert layer_bytes == 2 * (4096 * 6144 + 4096 * 4096 + 4096 * 2 * 14336 + 14336 * 4096 + 2 * 4096)
    assert [plan_offload(gb * GiB, layer_bytes, 32).num_layers for gb in (2, 4, 8)] == [5, 10, 20]


def _model(arch: object, host_layers: int = 0) -> CausalLM:
    return CausalLM(arch, preset_hf_config("tiny"), TorchPagedAttention(BLOCK), 64,  # type: ignore[arg-type]
                    host_layers=host_layers)


def _run(model: CausalLM, arch: object, prepare: object = None) -> list[torch.Tensor]:
    """Logits of a prefill step (two sequences) then a decode step, on a fresh KV cache."""
    shape = (16, BLOCK, arch.num_kv_heads, arch.head_dim)  # type: ignore[attr-defined]
    caches: list[KVCache] = [(torch.zeros(shape), torch.zeros(shape))
                             for _ in range(arch.num_layers)]  # type: ignore[attr-defined]
    steps = [(AttentionBatch([5, 3], [5, 3], [[1, 2], [3]], [4, 5, 6, 7, 8, 12, 13, 14]), [0, 1, 2, 3, 4, 0, 1, 2]),
             (AttentionBatch([1, 1], [6, 4], [[1, 2], [3]], [9, 15]), [5, 3])]
    g = torch.Generator().manual_seed(3)
    out = []
    with torch.inference_mode():
        for batch, positions in steps:
            if callable(prepare):
                prepare()
            ids = torch.randint(0, 512, (len(positions),), generator=g)
            meta = model.layers[-1].self_attn.backend.build_metadata(batch, CPU)
            out.append(model.compute_logits(model(ids, torch.as_tensor(positions), caches, meta)))
    return out


def test_streamed_layers_give_bit_identical_logits() -> None:
    """Four layers, the first three offloaded: their weights live in separate host buffers; layers 0 and 2 compute
    from staging buffer 0 and layer 1 from buffer 1, each refilled (layer i + 2 after layer i) as the forward goes.
    The logits equal the resident model's bit for bit, also when the buffers hold garbage before every step (so
    each forward copies what it uses, in time)."""
    arch = dataclasses.replace(EngineArgs(model="tiny", load_format="dummy").create_engine_config().model.arch,
                               num_layers=4)
    resident = _model(arch)
    resident.init_dummy_weights(0)
    want = _run(resident, arch)

    offloaded = _model(arch, host_layers=3)
    assert all(p.device.type == "meta" for p in offloaded.layers[0].parameters())  # built without memory
    stream = LayerWeightStream(offloaded.layers[:3], compute_device=CPU, host_device=CPU, pin_memory=False)
    offloaded.weight_stream = stream
    offloaded.init_dummy_weights(0, CPU)  # written into the host buffers
    stream.activate()
    assert len(stream.buffers) == 2
    buffers = [buffer.data_ptr() for buffer in stream.buffers]
    for index, layer in enumerate(offloaded.layers):
        ptrs = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        assert ptrs == ({buffers[index % 2]} if index < 3 else ptrs - set(buffers))
    for index in range(3):  # each host buffer holds its own layer's weights
        stream.load(index)
        for mine, theirs in zip(offloaded.layers[index].parameters(), resident.layers[index].parameters(),
                                strict=True):
            assert torch.equal(mine, theirs)
    assert stream.host_bytes == 3 * parameter_bytes(resident.layers[0])

    def scribble() -> None:
        for buffer in stream.buffers:
            buffer.fill_(0x7F)

    got = _run(offloaded, arch, prepare=scribble)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)

    # Loading a state dict (as the safetensors path does) also lands in host memory.
    loaded = _model(arch, host_layers=3)
    loaded.weight_stream = LayerWeightStream(loaded.layers[:3], CPU, pin_memory=False)
    loaded.load_state_dict(resident.state_dict())
    loaded.weight_stream.activate()
    for a, b in zip(want, _run(loaded, arch), strict=True):
        assert torch.equal(a, b)


def test_stream_over_resident_layers_keeps_their_values() -> None:
    arch = EngineArgs(model="tiny", load_format="dummy").create_engine_config().model.arch
    model = _model(arch)
    model.init_dummy_weights(1)
    want = _run(model, arch)
    model.weight_stream = LayerWeightStream(model.layers[:1], CPU, pin_memory=False)
    model.weight_stream.activate()
    for a, b in zip(want, _run(model, arch), strict=True):
        assert torch.equal(a, b)


def test_refusals_name_the_flag() -> None:
    with pytest.raises(ValueError, match=r"--cpu-offload-gb 2 needs a CUDA GPU \(device is 'cpu'\)"):
        EngineArgs(model="tiny", load_format="dummy", device="cpu", cpu_offload_gb=2).create_engine_config()
    with pytest.raises(ValueError, match=r"cpu_offload_gb \(--cpu-offload-gb\) must be >= 0, got -1"):
        EngineArgs(model="tiny", load_format="dummy", cpu_offload_gb=-1).create_engine_config()
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 is not supported yet"):
        EngineArgs(model="tiny", cpu_offload_gb=1, tensor_parallel_size=2).validate_cpu_offload("cuda")
    with pytest.raises(ValueError, match="quantization='fp8' is not supported yet"):
        EngineArgs(model="tiny", cpu_offload_gb=1, quantization="fp8").validate_cpu_offload("cuda:0")
    EngineArgs(model="tiny", cpu_offload_gb=1).validate_cpu_offload("cuda")  # fine on a GPU
    config = EngineArgs(model="tiny", load_format="dummy", device="cpu", cpu_offload_gb=0).create_engine_config()
    assert config.cache.cpu_offload_bytes == 0  # the default: a no-op


def test_flag_on_every_command_and_forwarded_to_workers(capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    for argv in (["serve"], ["prefill", "--port", "1"], ["decode", "--port", "1"], ["generate", "hi"],
                 ["bench", "throughput"]):
        args = parser.parse_args(prepare_argv(parser, [*argv, "--cpu_offload_gb", "2.5"]))
        assert args.cpu_offload_gb == 2.5, argv
        assert EngineArgs.from_cli_args(args).cpu_offload_gb == 2.5
    assert engine_argv(EngineArgs(cpu_offload_gb=4)) == ["--cpu-offload-gb", "4"]
    assert "--cpu-offload-gb" not in engine_argv(EngineArgs())
    # On this CPU machine: one clear line, before any worker starts or any model loads.
    for argv in (["serve", "--model", "tiny", "--load-format", "dummy", "--cpu-offload-gb", "2", "--device", "cpu"],
                 ["generate", "hi", "--model", "tiny", "--load-format", "dummy", "--cpu-offload-gb", "2",
                  "--device", "cpu"]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("kvflow: error: --cpu-offload-gb 2 needs a CUDA GPU"), err


def test_llm_takes_the_engine_arg() -> None:
    from kvflow import LLM

    with pytest.raises(ValueError, match="--cpu-offload-gb 1 needs a CUDA GPU"):
        LLM("tiny", load_format="dummy", device="cpu", cpu_offload_gb=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_offload_keeps_greedy_outputs_and_frees_gpu_memory() -> None:
    """On a GPU: a bf16 Qwen2.5-0.5B-shaped dummy model with CUDA graphs, greedy ids with the leading layers
    offloaded equal the resident engine's (same dummy weights: drawn on the GPU either way), and the GPU holds only
    the other layers' weights plus one staging buffer."""
    from kvflow import LLM, SamplingParams

    prompts = [{"prompt_token_ids": list(range(10 + i, 40 + i))} for i in range(4)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    kw = dict(load_format="dummy", dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=64 << 20,
              cudagraph_capture_sizes=[1, 2, 4])
    resident = LLM("qwen2.5-0.5b", **kw)
    want = [o.outputs[0].token_ids for o in resident.generate(prompts, params)]
    del resident
    torch.cuda.empty_cache()
    offloaded = LLM("qwen2.5-0.5b", cpu_offload_gb=0.1, **kw)
    assert offloaded.llm_engine.runner.graphs is not None
    got = [o.outputs[0].token_ids for o in offloaded.generate(prompts, params)]
    assert got == want
    model = offloaded.llm_engine.runner.model
    stream = model.weight_stream
    assert stream is not None and stream.num_layers >= 3 and len(stream.buffers) == 2
    on_gpu = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    assert all(buffer.data_ptr() in on_gpu for buffer in stream.buffers)
    resident_bytes = sum(on_gpu.values()) - sum(buffer.nbytes for buffer in stream.buffers)
    assert resident_bytes == parameter_bytes(model) - stream.num_layers * parameter_bytes(model.layers[0])
