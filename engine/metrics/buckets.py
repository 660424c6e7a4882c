"""Histogram bucket boundaries (seconds) of kvflow's Prometheus metrics, for every process, in one place.

The request-latency histograms use vLLM's boundaries. The workers' engines carry vLLM's current long tails
(time to first token up to 2,560 s, end-to-end latency up to 7,680 s); the router's stop where vLLM's used to end
(160 s and 960 s). Both sets stay as they are exported: a histogram's `le` labels are part of its contract with
dashboards and alert rules, so aligning them is a change of metrics, not of where they are written down.
Nothing here imports: the router reads it without loading the engine.
"""

# ---- request latency (vLLM's metric names, on the router and on every worker) ---------------------------------------
ROUTER_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                       20.0, 40.0, 80.0, 160.0)
TTFT_BUCKETS = (*ROUTER_TTFT_BUCKETS, 640.0, 2560.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                80.0)
ROUTER_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                      480.0, 960.0)
E2E_BUCKETS = (*ROUTER_E2E_BUCKETS, 1920.0, 7680.0)

# ---- kvflow's own -------------------------------------------------------------------------------------------------
# tokens routed to one expert of one MoE layer in one step
MOE_EXPERT_TOKENS_BUCKETS = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
                             8192.0, 16384.0)
KV_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
INDEX_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
ROUTE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)
