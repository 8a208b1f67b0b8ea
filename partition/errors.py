"""``LayoutError``: a layout that cannot run, naming the config key to change.

Raised by the layout checks (``partition.layouts.axes``, ``partition.pipeline.schedules``) that the run config,
the runtime and the planner share, so each mistake gets one message wherever it is caught.

    raise LayoutError("mesh.ep", "3 does not divide model.n_experts = 8; use one of [1, 2, 4, 8]")
"""

from __future__ import annotations


class LayoutError(ValueError):
    """A layout that cannot run; ``key`` is the config key to change (``"mesh.ep"``).

    The message reads ``"<key>: <what is wrong>; <how to fix it>"``.
    """

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key
