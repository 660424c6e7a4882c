"""torch.distributed KV links: a prefill worker sends KV slices to a decode worker over NCCL (GPU to GPU) or gloo
(CPU workers, the same code path without GPUs), while gRPC carries the control.

One link per (prefill worker, decode worker) pair, opened by the decode worker on first use through the prefill
worker's `KVLink` RPC. That stream first says how to rendezvous (store.py: NCCL and gloo links alike through the
authenticated `KVLinkStore` RPC, every rank of both workers), then
carries one notice per link message, then heartbeats. Each link is its own 2-rank process group (prefill rank 0,
decode rank 1), built from the store: no global default group, so a worker can hold links to many peers.

- group.py: the pair's process group, the rendezvous and the heartbeat (what both ends share);
- store.py: a link's store over the `KVLinkStore` RPC (bounded, only the link's own keys);
- send.py: the prefill end (`SendLink`, the `KVLink` RPC, a request's `LinkSender`);
- recv.py: the decode end of one link (`RecvLink`);
- pull.py: the decode worker's links and the `KVReceiver` over them (`LinkReceiver`);
- heads.py: which heads each (prefill rank, decode rank) pair of a link between tensor-parallel workers moves;
- ranks.py, tell.py: the link agent of a tensor-parallel rank > 0 (its own pair groups) and how rank 0 drives it.

Tensor-parallel workers: a link is one 2-rank group per (prefill rank, decode rank) pair that moves heads (prefill
TP and decode TP may differ; the receiving rank pulls the heads it holds from the rank that holds them, a replicated
head from one rank only). Rank 0 of each side runs the KVLink stream and numbers the slices as above; it tells its
other ranks each slice (export after the step that computed it; receive, then import before the next step), and a
decode rank > 0 acks each received slice in its worker's TP store before rank 0 counts the slice. A link's ranks
> 0 (processes without a gRPC server) rendezvous over the prefill worker's `KVLinkStore` RPC like rank 0: rank 0
tells them the prefill worker's address, and they dial it with the credential their worker handed them in the
environment (cluster/auth.py `env` / `from_env`).

Invariants:
- Message order. The prefill side numbers messages on the engine thread and queues the send and the notice in
  that same order; its link thread sends in that order, and the notices reach the decode side in that order on
  one stream. The decode side receives strictly in notice order, also for a request it no longer wants (it then
  drops the data), so two-sided send/recv always pair up.
- No hang reaches the engine. Sends and receives run on each side's link thread, never on the engine thread or
  the event loop; device waits poll, so a link found dead stops its thread.
- Death is noticed within `LINK_DEAD_S`: the KVLink stream ends when either process dies, and the prefill side
  sends a heartbeat every `HEARTBEAT_S`. A dead link is torn down (its communicator aborted) on both sides; its
  pending pulls fail (the decode side recomputes), and the next pull to that peer opens a new link.
- A pull's blocks are written on the device (the import completed) before the pull succeeds, and no write into
  them starts after `forget(request_id)` returns, so the engine may free or reuse them at once.

Trust: `KVLink` is a worker RPC like the others, served only to holders of the cluster credential
(cluster/auth.py), and decode workers open links only to allowed prefill workers (decode_worker/allowlist.py). A link's
rendezvous rides that authenticated channel too, NCCL or gloo, for every rank of both workers: tensor-parallel ranks
> 0 present the same credential (a call without it is UNAUTHENTICATED), and no link opens a store port. The
NCCL/gloo data sockets of every link have no authentication of their own. Whoever reaches
them could disturb a link's setup or take the decode worker's place in a new link and receive KV (prompt contents).
Only the network keeps strangers out: the Helm chart's NetworkPolicies admit only decode pods to prefill pods' other
ports; elsewhere, run links between hosts on a private network, or use `--kv-transfer-backend grpc` (KV inside the
authenticated, optionally mTLS, Prefill stream).
"""

RANK_MODULE = "cluster.transfer.link.ranks"  # a tensor-parallel rank > 0 of a worker with KV links
