"""The worker runtime both roles share (prefill_worker/ and decode_worker/ hold only their role's servicers):
CLI flags (args.py), process lifecycle, health, Info and the drain (runtime.py), KV events, peer channels and
passing threads. The KV transport it builds for every worker lives in cluster/transfer/."""
