"""Pipeline parallelism: a traced loss split into stages, each stage's backward split into input
and weight gradients, per-stage programs, and the schedules that order them."""
