"""Pure-function models: each module exposes ``Config``, ``init``, ``param_axes``, ``apply``, ``loss``."""
