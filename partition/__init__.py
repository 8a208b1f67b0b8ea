"""The partitioner: mesh, specs, trace, propagate, lower, compile, reports."""
