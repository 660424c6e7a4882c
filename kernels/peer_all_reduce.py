"""One-shot all-reduce over peer GPU memory (CUDA IPC over NVLink), for the tensor-parallel decode path.

Each rank copies its input into its own IPC buffer, raises a flag in every peer's signal area, waits for every
peer's flag, then reads all ranks' buffers and sums them in rank order in fp32 (so every rank gets the same bits)
back into its input. One launch, no NCCL proxy, capturable in CUDA graphs: the shape TensorRT-LLM and vLLM use
below ~512 KB, where NCCL's ring costs ~17 µs on an H100/H200 pair (bench/results/tp_allreduce_h200.json).

Invariants the kernel relies on (engine/parallel/peer_all_reduce.py keeps them):
- every rank launches the same sequence of calls with the same `numel`, and always `PROGRAMS` programs, so each
  program's epoch counter (in this rank's signal area, touched only by that program) advances in lockstep on all
  ranks;
- program p copies, signals, waits for and sums only slice p, so it only needs program p of each peer to be past
  the copy: one barrier per call, no grid-wide one;
- buffers alternate halves by epoch parity: a rank's program p writes half e % 2 at call e only after passing the
  barrier of call e - 1 with every peer's program p, and a GPU runs one call's kernel only after the previous one
  finished, so no peer still reads that half (it read it at call e - 2);
- under programmatic dependent launch (the decode step's kernels use it, kernels/_triton.py) the kernel waits for
  the previous one before touching anything, and lets the next one be scheduled at once: its programs wait in
  their own `gdc_wait` until this kernel has finished, so the launch gap is hidden as between the other kernels
  (without it the one-shot was slower end to end than NCCL, whose kernels overlap their neighbours');
- a peer that never arrives (dead process) ends the wait after `timeout_ns` of GPU time: the program sets the
  error word and goes on, so the GPU is never wedged. The engine never uses such a result: rank 0's watchdog has
  failed the engine (dead rank, overrun step) before the wait ends (engine/parallel/peer_all_reduce.py sets the
  timeout to twice the group's); the benchmark reads the word (`PeerAllReduce.failed`).

Signal area of one rank, int32 words: [0, P) epoch counters, [P, P + P * W) flags (program p, from rank r at
P + p * W + r), P + P * W the error word.
"""

from __future__ import annotations

import torch

from kernels._triton import HAS_TRITON, pdl_launch, pdl_wait, require_triton, tl, triton

__all__ = ["peer_all_reduce", "signal_words", "PEER_BLOCK"]

PEER_BLOCK = 1024  # elements per program per iteration: 8 per thread at 4 warps (16-byte loads in bf16)


def signal_words(programs: int, world: int) -> int:
    """int32 words in one rank's signal area (counters, flags, error word)."""
    return programs * (1 + world) + 1


if HAS_TRITON:
    from triton.language.extra.cuda import globaltimer

    @triton.jit
    def _peer_all_reduce_kernel(x_ptr, buffer_addrs, signal_addrs, numel, per_program, timeout_ns,
                                CAPACITY: tl.constexpr, RANK: tl.constexpr, WORLD: tl.constexpr,
                                PROGRAMS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_wait(PDL)  # the previous kernel's output (x) is complete; the next kernel may be scheduled now
        pid = tl.program_id(0)
        dtype = x_ptr.dtype.element_ty
        my_signal = tl.load(signal_addrs + RANK).to(tl.pointer_type(tl.int32))
        epoch = tl.load(my_signal + pid, volatile=True) + 1
        half = (epoch & 1).to(tl.int64) * CAPACITY
        start = pid.to(tl.int64) * per_program
        end = tl.minimum(start + per_program, numel)
        # IPC buffers are allocation bases (256-byte aligned) and every slice starts at a multiple of BLOCK:
        # say so, or the casts from integers leave Triton assuming 1-byte alignment (scalar loads)
        my_buffer = tl.multiple_of(tl.load(buffer_addrs + RANK).to(tl.pointer_type(dtype)) + half, 16)
        for off in range(start, end, BLOCK):
            idx = tl.max_contiguous(tl.multiple_of(off + tl.arange(0, BLOCK), BLOCK), BLOCK)
            mask = idx < end
            tl.store(my_buffer + idx, tl.load(x_ptr + idx, mask=mask), mask=mask)
        tl.debug_barrier()  # every thread's copy is done before the flag says so (the release covers them)
        for r in tl.static_range(WORLD):
            if r != RANK:
                peer_signal = tl.load(signal_addrs + r).to(tl.pointer_type(tl.int32))
                tl.atomic_xchg(peer_signal + PROGRAMS + pid * WORLD + RANK, epoch, sem="release", scope="sys")
        late = 0
        for r in tl.static_range(WORLD):
            if r != RANK:
                flag = my_signal + PROGRAMS + pid * WORLD + r
                began = globaltimer()
                seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                # `seen - epoch < 0` (int32, wrapping): the peer has not reached this call; a peer may already
                # be one call ahead, so equality is not the test
                while ((seen - epoch) < 0) & ((globaltimer() - began) < timeout_ns):
                    seen = tl.atomic_add(flag, 0, sem="acquire", scope="sys")
                late = late | ((seen - epoch) < 0).to(tl.int32)
        if late != 0:
            tl.atomic_xchg(my_signal + PROGRAMS * (1 + WORLD), 1)
        tl.debug_barrier()
        for off in range(start, end, BLOCK):
            idx = tl.max_contiguous(tl.multiple_of(off + tl.arange(0, BLOCK), BLOCK), BLOCK)
            mask = idx < end
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for r in tl.static_range(WORLD):
                if r == RANK:
                    acc += tl.load(x_ptr + idx, mask=mask, other=0.0).to(tl.float32)
                else:
                    peer = tl.multiple_of(tl.load(buffer_addrs + r).to(tl.pointer_type(dtype)) + half, 16)
                    acc += tl.load(peer + idx, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
            tl.store(x_ptr + idx, acc.to(dtype), mask=mask)
        tl.store(my_signal + pid, epoch)


def peer_all_reduce(x: torch.Tensor, buffer_addrs: torch.Tensor, signal_addrs: torch.Tensor, rank: int,
                    world: int, capacity: int, programs: int, timeout_ns: int) -> torch.Tensor:
    """Sum `x` (contiguous, at most `capacity` elements) in place across the `world` ranks whose IPC buffers
    (`capacity` elements per half, two halves) and signal areas are at the addresses in `buffer_addrs` /
    `signal_addrs` (int64 tensors on x's device, rank order). Every rank must make the same calls."""
    require_triton("peer_all_reduce")
    if not x.is_contiguous():
        raise ValueError("peer_all_reduce needs a contiguous tensor")
    numel = x.numel()
    if numel > capacity:
        raise ValueError(f"peer_all_reduce takes at most {capacity} elements, got {numel}")
    per_program = triton.cdiv(triton.cdiv(max(numel, 1), programs), PEER_BLOCK) * PEER_BLOCK
    _peer_all_reduce_kernel[(programs,)](x, buffer_addrs, signal_addrs, numel, per_program, timeout_ns,
                                         CAPACITY=capacity, RANK=rank, WORLD=world, PROGRAMS=programs,
                                         BLOCK=PEER_BLOCK, num_warps=4, **pdl_launch(x.device))
    return x
