"""KV bookkeeping and scheduling: blocks, prefix hashes, requests, the continuous-batching scheduler."""
