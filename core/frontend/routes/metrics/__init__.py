"""/metrics, in Prometheus text format."""
