"""Prefix-aware routing: a block index fed by workers' KV events, and the policies that read it. Cluster code, so it
lives beside the shared worker runtime (cluster/worker/), not in engine/: nothing here touches an engine."""
