"""CPU swap space for preemption in swap mode: which CPU block holds which swapped-out device block."""

from __future__ import annotations


class SwapSpace:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))
        self.req_to_cpu_blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def swap_out(self, request_id: str, device_block_ids: list[int]) -> list[tuple[int, int]] | None:
        """Reserve CPU blocks for a request's device blocks; None (nothing reserved) if space is short."""
        if len(device_block_ids) > len(self._free):
            return None
        cpu_blocks = [self._free.pop() for _ in device_block_ids]
        self.req_to_cpu_blocks[request_id] = cpu_blocks
        return list(zip(device_block_ids, cpu_blocks, strict=True))

    def swap_in(self, request_id: str, device_block_ids: list[int]) -> list[tuple[int, int]]:
        """Pairs (cpu block, device block) to copy back; the CPU blocks are free again afterwards."""
        cpu_blocks = self.req_to_cpu_blocks.pop(request_id)
        self._free.extend(cpu_blocks)
        return list(zip(cpu_blocks, device_block_ids, strict=True))

    def discard(self, request_id: str) -> None:
        self._free.extend(self.req_to_cpu_blocks.pop(request_id, []))
