"""Chained prefix-block hashes that every process computes identically.

A block's hash covers (parent hash, its token ids, extra keys) in canonical bytes, so two processes, two runs or
a router and a worker agree without sharing state. The chain root is seeded by the model identity and block
size: blocks of different models never collide in a shared index. No Python `hash()` and no pickle: both vary
across processes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

HASH_VERSION = b"kvflow-block-hash-v1"
DIGEST_BYTES = 16
# Part of the hash contract, like HASH_VERSION: every process of a cluster (engines, router, speculative
# proposer) must hash with the same value, whatever its sampling seed, so no caller chooses it.
HASH_SEED = 0


def _length_prefixed(parts: Sequence[str]) -> bytes:
    out = bytearray()
    for part in parts:
        raw = part.encode("utf-8")
        out += len(raw).to_bytes(4, "little") + raw
    return bytes(out)


@dataclass(frozen=True)
class BlockHasher:
    """Hashes full KV blocks of token ids into a chain seeded per model."""

    root: bytes
    block_size: int

    @classmethod
    def for_model(cls, model_id: str, block_size: int) -> BlockHasher:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        material = HASH_VERSION + _length_prefixed([model_id]) + block_size.to_bytes(4, "little")
        material += HASH_SEED.to_bytes(8, "little", signed=True)
        return cls(root=hashlib.blake2b(material, digest_size=DIGEST_BYTES).digest(), block_size=block_size)

    def hash_block(self, parent: bytes | None, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> bytes:
        """Hash one full block given its parent's hash (None for the first block)."""
        if len(token_ids) != self.block_size:
            raise ValueError(f"only full blocks are hashed: got {len(token_ids)} of {self.block_size} tokens")
        tokens = np.asarray(token_ids, dtype="<u4").tobytes()
        return self._digest(parent, tokens, _length_prefixed(extra_keys))

    def hash_blocks(
        self,
        token_ids: Sequence[int],
        parent: bytes | None = None,
        extra_keys: Sequence[str] = (),
    ) -> list[bytes]:
        """Hashes of every full block of `token_ids`, chained from `parent` (a partial tail is skipped)."""
        num_full = len(token_ids) // self.block_size
        if num_full == 0:
            return []
        raw = np.asarray(token_ids[: num_full * self.block_size], dtype="<u4").tobytes()
        extra = _length_prefixed(extra_keys)
        step = self.block_size * 4
        header = step.to_bytes(4, "little")
        digest = hashlib.blake2b
        hashes: list[bytes] = []
        parent = parent if parent is not None else self.root
        # The same bytes as `_digest`, fed in one call: this loop runs per 16 tokens of every routed prompt.
        for i in range(num_full):
            parent = digest(parent + header + raw[i * step : (i + 1) * step] + extra, digest_size=DIGEST_BYTES).digest()
            hashes.append(parent)
        return hashes

    def _digest(self, parent: bytes | None, token_bytes: bytes, extra: bytes) -> bytes:
        digest = hashlib.blake2b(digest_size=DIGEST_BYTES)
        digest.update(parent if parent is not None else self.root)
        digest.update(len(token_bytes).to_bytes(4, "little"))
        digest.update(token_bytes)
        digest.update(extra)
        return digest.digest()
