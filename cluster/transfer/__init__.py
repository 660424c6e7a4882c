"""The KV transport's one home: how a prompt's KV blocks move from a prefill worker to a decode worker.

- contract.py: what a pull asks for and reports, how blocks are cut into messages, the lease;
- backends.py: the backends' names (CLI choices, wire enums);
- protocols.py: `KVSender` (prefill side of one request) and `KVReceiver` (decode side), as the roles hold them;
- registry.py: which sender and receiver a worker gets, by backend;
- prefill_stream.py: the decode side of the `Prefill` call every pull makes;
- grpc/: blocks as bytes in the Prefill stream; link/: blocks over a torch.distributed link (NCCL or gloo);
- faults.py: injected transfer faults (fault tests only).

The engine side of a transfer stays in the engine: engine/kv_port.py (export/import of blocks) and
engine/kv_layout.py (the wire layout).
"""
