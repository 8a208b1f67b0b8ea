"""The partitioner: mesh, specs, trace, propagate, lower, compile, reports."""

import logging as _logging

# DTensor warns each time a value partial over two mesh dims is reduced with two all-reduces;
# shardfn reports every collective it emits (comm_report), so the warning is noise here.
_logging.getLogger("torch.distributed.tensor._redistribute").setLevel(_logging.ERROR)
