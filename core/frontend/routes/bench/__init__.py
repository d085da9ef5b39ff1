"""/bench/weight_read, the bandwidth floor of a batch-1 step."""
