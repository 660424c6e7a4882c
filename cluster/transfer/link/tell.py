"""How rank 0 of a tensor-parallel worker drives its other ranks' link agents (cluster/transfer/link/ranks.py), and
how they answer.

- Rank 0 -> rank r: JSON frames (no pickle) down the engine's rank pipe (`KVRanks.tell`), handled by the rank's
  main thread in order with the steps: an export told after a step reads the blocks that step computed, an import
  told before a step lands before it.
- Rank r -> rank 0: keys in the ranks' shared c10d store (`KVRanks.store`, the tensor-parallel group's TCPStore on
  the loopback): "ok" or a failure under `ack_key`, which rank 0 reads once and deletes.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

from engine.kv_port import KVRanks

# How often rank 0 checks for an ack: a loopback store round trip. (A bounded store wait would not poll, but each
# timeout logs a c10d warning.)
ACK_POLL_S = 0.001


def tell_ranks(ranks: KVRanks, doc: dict[str, Any]) -> None:
    """Raises TensorParallelError (the engine's) when a rank is gone."""
    if ranks.tell is None:
        raise RuntimeError("this worker's other tensor-parallel ranks cannot be told anything (not rank 0)")
    ranks.tell(json.dumps(doc, separators=(",", ":")).encode())


def ranks_alive(ranks: KVRanks) -> bool:
    if ranks.check is None:
        return True
    try:
        ranks.check()
    except Exception:  # noqa: BLE001 - any failure means a rank is gone
        return False
    return True


def ack_key(link_id: str, rank: int, what: str) -> str:
    return f"kvflow-link/{link_id}/{rank}/{what}"


def wait_acks(ranks: KVRanks, keys: list[str], broken: threading.Event) -> str | None:
    """Wait until every key is set (each is then deleted): None if all say "ok", else the first failure. Stops
    early if the link broke or a rank is gone."""
    for key in keys:
        while not ranks.store.check([key]):
            if broken.is_set():
                return "the link broke"
            if not ranks_alive(ranks):
                return "a tensor-parallel rank is gone"
            time.sleep(ACK_POLL_S)
        value = ranks.store.get(key)
        ranks.store.delete_key(key)
        if value != b"ok":
            return value.decode(errors="replace")
    return None
