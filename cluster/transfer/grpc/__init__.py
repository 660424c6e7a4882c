"""The gRPC backend: KV blocks as raw bytes in `KVChunk` messages of the `Prefill` stream itself (any two workers
that can talk, no rendezvous)."""
