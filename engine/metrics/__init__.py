"""Engine counters, the periodic stats line and the Prometheus exporter."""
