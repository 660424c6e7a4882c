"""A tensor-parallel rank > 0 of a worker with KV links: `python -m cluster.transfer.link.ranks`, the engine's rank
process (engine/parallel/worker.py) with a link agent that moves this rank's KV heads over its own pair groups.

Rank 0 tells the agent what to do (cluster/transfer/link/tell.py), on this process's main thread in order with the
steps:
- prefill side: "open_send" (join this rank's pairs of a link), "export" (gather a slice's heads for each pair,
  right after the step that computed them, and queue it on the link's send thread), "close";
- decode side: "open_recv", "recv" (the link thread receives a slice's heads into staging, then acks "ok" in the
  ranks' store), "import" (write a staged slice into blocks: before the next step, which may read them), "drop"
  (the pull no longer wants it), "close".

Invariants: this rank never decides whether a pull wants a slice (rank 0 does, under the pull's lock), never
imports a slice rank 0 has not told it to, and receives every slice it is told of, in order, so its pairs stay
paired. A failure ends this rank's side of the link and is acked as such; rank 0 then ends the link.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import threading
from typing import Any

import grpc
import torch
import torch.distributed as dist

from cluster.auth import ClusterAuth
from cluster.transfer.link.group import DECODE_RANK, RankGroups, on_device
from cluster.transfer.link.heads import HeadPlan, assemble, plan_heads
from cluster.transfer.link.send import SendLoop
from cluster.transfer.link.store import dial_link_store
from cluster.transfer.link.tell import ack_key
from engine.kv_layout import KVSlice
from engine.kv_port import KVPort
from engine.parallel import worker
from engine.parallel.executor import kv_ranks
from engine.parallel.group import TPGroup
from engine.runner.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def _slice(raw: list[int]) -> KVSlice:
    return KVSlice(*(int(v) for v in raw))


def _link_store(doc: dict[str, Any], channels: list[grpc.Channel]) -> dist.Store:
    """The link's rendezvous store: the prefill worker's `KVLinkStore` RPC at the address rank 0 told, with the
    credential this process got from its worker's environment (the channel goes into `channels`, for the caller to
    close)."""
    timeout_s = float(doc["timeout_s"])
    store, channel = dial_link_store(doc["address"], doc["link"], timeout_s, ClusterAuth.from_env())
    channels.append(channel)
    return store


def _close_channels(channels: list[grpc.Channel]) -> None:
    for channel in channels:
        with contextlib.suppress(Exception):  # closing twice, or at exit
            channel.close()


def _plan(doc: dict[str, Any]) -> HeadPlan:
    return plan_heads(tuple(tuple(r) for r in doc["src"]), tuple(tuple(r) for r in doc["dst"]))


class RecvLoop:
    """This rank's receives of one link: its pair groups, staged slices by seq, acks in the ranks' store."""

    def __init__(self, link_id: str, port: KVPort, plan: HeadPlan, store: Any) -> None:
        self.link_id = link_id
        self.port = port
        self.plan = plan
        self.pairs = plan.receiving(port.rank)
        self.broken = threading.Event()
        self.staged: dict[int, tuple[KVSlice, list[torch.Tensor]]] = {}
        self._acks = store  # the ranks' store (rank 0 reads the acks)
        self._inbox: queue.SimpleQueue[tuple[int, KVSlice] | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._groups: RankGroups | None = None

    def start(self, doc: dict[str, Any]) -> None:
        threading.Thread(target=self._run, args=(doc,), name=f"kv-link-recv-{self.link_id}", daemon=True).start()

    def expect(self, seq: int, part: KVSlice) -> None:
        self._inbox.put((seq, part))

    def take(self, seq: int) -> tuple[KVSlice, list[torch.Tensor]] | None:
        with self._lock:
            return self.staged.pop(seq, None)

    def close(self) -> None:
        """Main thread: end the link here; a receive in progress fails now (its groups are aborted)."""
        self.broken.set()
        self._inbox.put(None)
        if self._groups is not None:
            self._groups.close(failed=True)

    def _ack(self, what: str, value: str) -> None:
        self._acks.set(ack_key(self.link_id, self.port.rank, what), value)

    def _run(self, doc: dict[str, Any]) -> None:
        groups = None
        channels: list[grpc.Channel] = []
        try:
            with on_device(self.port.device):
                store = _link_store(doc, channels)
                groups = RankGroups(doc["backend"], store, doc["prefix"], self.pairs, DECODE_RANK,
                                    float(doc["timeout_s"]))
                self._groups = groups
                with self.port.transfer_stream(self.port.new_stream()):
                    if not groups.hello(self.port.device, self.broken):
                        raise RuntimeError("the link broke during its setup")
                    self._ack("ready", "ok")
                    self._receive_all(groups)
        except Exception as exc:  # noqa: BLE001 - any failure ends this rank's side; rank 0 ends the link
            logger.warning("KV link %s (rank %d receive side) failed: %s", self.link_id, self.port.rank, exc)
            self.broken.set()
            with contextlib.suppress(Exception):
                self._ack("ready", f"failed: {exc}")
            self._fail_pending(str(exc))
        finally:
            self.broken.set()
            if groups is not None:
                groups.close(failed=True)
            _close_channels(channels)

    def _receive_all(self, groups: RankGroups) -> None:
        while True:
            item = self._inbox.get()
            if item is None or self.broken.is_set():
                return
            seq, part = item
            buffers = [self.port.empty_wire(part, len(pair.heads)) for pair in self.pairs]
            if not groups.recv(buffers, self.port.device, self.broken):
                raise RuntimeError("the link broke mid-slice")
            with self._lock:
                self.staged[seq] = (part, buffers)
            self._ack(str(seq), "ok")

    def _fail_pending(self, reason: str) -> None:
        """Ack every slice still expected as failed, so rank 0 stops waiting at once."""
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None:
                with contextlib.suppress(Exception):
                    self._ack(str(item[0]), f"failed: {reason}")


class LinkAgent:
    """A `RankExtension` (engine/parallel/worker.py): this rank's ends of its worker's KV links."""

    def __init__(self, runner: ModelRunner, group: TPGroup) -> None:
        self.runner = runner
        self.group = group
        self._port: KVPort | None = None
        self.sends: dict[str, tuple[SendLoop, HeadPlan]] = {}
        self.recvs: dict[str, RecvLoop] = {}
        self._channels: dict[str, list[grpc.Channel]] = {}  # the send side's store channels, by link

    @property
    def port(self) -> KVPort:
        """Built on first use: the KV cache exists only after the engine sized it."""
        if self._port is None:
            runner = self.runner
            self._port = KVPort(runner.kv_caches, runner.kv_dtype_name, runner.kv_scales, kv_ranks(runner),
                                self.group.rank)
        return self._port

    def handle(self, body: bytes) -> None:
        doc = json.loads(body)
        getattr(self, f"_on_{doc['op']}")(doc)

    def close(self) -> None:
        for loop, _ in self.sends.values():
            loop.close(wait_s=5.0, graceful=True)
        for recv in self.recvs.values():
            recv.close()
        for channels in self._channels.values():
            _close_channels(channels)

    # ---- prefill side ----------------------------------------------------------------------------------------
    def _on_open_send(self, doc: dict[str, Any]) -> None:
        plan = _plan(doc)
        loop = SendLoop(f"{doc['link']}-r{self.group.rank}", doc["backend"], self.port,
                        plan.sending(self.group.rank))
        self.sends[doc["link"]] = (loop, plan)
        channels = self._channels.setdefault(doc["link"], [])
        # The store is reached on the link thread: this (main) thread must get back to the steps at once.
        loop.start(lambda: _link_store(doc, channels), doc["prefix"], float(doc["timeout_s"]), lambda: None)

    def _on_export(self, doc: dict[str, Any]) -> None:
        entry = self.sends.get(doc["link"])
        if entry is None or entry[0].broken.is_set():
            return  # the link is gone: the decode side recomputes
        loop, plan = entry
        part = _slice(doc["part"])
        loop.put([self.port.export(doc["blocks"], part, plan.export_heads(pair)) for pair in loop.pairs])

    # ---- decode side -----------------------------------------------------------------------------------------
    def _on_open_recv(self, doc: dict[str, Any]) -> None:
        recv = RecvLoop(doc["link"], self.port, _plan(doc), self.group.store)
        self.recvs[doc["link"]] = recv
        recv.start(doc)

    def _on_recv(self, doc: dict[str, Any]) -> None:
        recv = self.recvs.get(doc["link"])
        if recv is not None:
            recv.expect(int(doc["seq"]), _slice(doc["part"]))

    def _on_import(self, doc: dict[str, Any]) -> None:
        recv = self.recvs.get(doc["link"])
        staged = recv.take(int(doc["seq"])) if recv is not None else None
        if recv is None or staged is None:  # rank 0 tells an import only after this rank acked the slice
            raise RuntimeError(f"KV link {doc['link']}: told to import slice {doc['seq']}, which is not staged")
        part, buffers = staged
        self.port.import_(doc["blocks"], part, assemble(buffers, recv.plan.assembly(self.group.rank))).wait()

    def _on_drop(self, doc: dict[str, Any]) -> None:
        recv = self.recvs.get(doc["link"])
        if recv is not None:
            recv.take(int(doc["seq"]))

    # ---- both ------------------------------------------------------------------------------------------------
    def _on_close(self, doc: dict[str, Any]) -> None:
        entry = self.sends.pop(doc["link"], None)
        if entry is not None:
            entry[0].close()
        _close_channels(self._channels.pop(doc["link"], []))
        recv = self.recvs.pop(doc["link"], None)
        if recv is not None:
            recv.close()


if __name__ == "__main__":
    worker.main(LinkAgent)
