"""Graph passes over a traced graph or a per-rank program: rematerialization, communication
overlap, gradient bucketing, grouped attention heads."""

DEFAULT_BUCKET_BYTES = 25 * 2**20
"""``partition.bucket_bytes``' default: PyTorch DDP's 25 MiB bucket (``bucket_cap_mb``). Used by
the gradient bucketing pass (``partition.passes.bucket``); kept here, where nothing is imported, so
a config loads without the pass."""
