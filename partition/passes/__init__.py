"""Graph passes over a traced graph or a per-rank program: rematerialization, communication
overlap, gradient bucketing, grouped attention heads."""
