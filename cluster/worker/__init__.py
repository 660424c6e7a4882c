"""The worker runtime both roles share (prefill_worker/ and decode_worker/ hold only their role's servicers):
process lifecycle, health, Info, KV events, and the torch.distributed KV links."""
