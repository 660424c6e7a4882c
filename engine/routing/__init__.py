"""Prefix-aware routing: a block index fed by workers' KV events, and the policies that read it."""
