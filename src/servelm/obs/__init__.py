"""Observability: per-request timelines, TTFT attribution, Prometheus metrics, request logs."""
