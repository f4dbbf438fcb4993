"""Per-rank training engine: FSDP2-sharded model + optimizer over packed, sequence-sharded micro-batches."""
