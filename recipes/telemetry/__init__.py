"""Run operations: metrics and their writers, the Prometheus exporter, experiment trackers."""
