"""What the benchmark scenarios share: timers (`timing`), the device ceilings they measure against (`ceilings`),
result records and device facts (`records`), engines driven to completion and `kvflow bench throughput` runs
(`runs`), `kvflow serve` clusters with their own log folders (`serving`) and configurations run each in a fresh
subprocess (`jobs`). Servers are started with `kvflow.benchmarks.server`, which `kvflow bench routing` uses too."""
