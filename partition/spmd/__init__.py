"""The SPMD compiler: trace a function, propagate placements over its graph, lower it to a
per-rank program with collectives, report what it moved."""
