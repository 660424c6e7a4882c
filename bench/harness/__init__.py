"""What the benchmark scenarios share: timers (`timing`), the device ceilings they measure against (`ceilings`),
result records and device facts (`records`), engines driven to completion (`runs`) and configurations run each
in a fresh subprocess (`jobs`). Servers under test are started with `kvflow.benchmarks.server`, which
`kvflow bench routing` uses too."""
