"""shardfn: JAX-style functional PyTorch.

Models are pure functions over parameter pytrees; a partitioner turns one traced training step
into per-rank programs for a named device mesh.

    import shardfn as sf
    from shardfn import P
    mesh = sf.Mesh({"dp": 2, "tp": 2})
    step = sf.jit(train_step, mesh=mesh, in_specs=(param_specs, P("dp")), out_specs=(param_specs, P()))
"""

__version__ = "0.1.0"

_EXPORTS = {
    "P": "shardfn.partition.spec",
    "AUTO": "shardfn.partition.spec",
    "specs_like": "shardfn.partition.spec",
    "Mesh": "shardfn.partition.mesh",
    "constrain": "shardfn.partition.constrain",
    "local_map": "shardfn.partition.local_map",
    "pipeline_split": "shardfn.partition.constrain",
    "register_autograd": "shardfn.partition.constrain",
    "jit": "shardfn.partition.api",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name):
    # Imported on first use, so `shardfn params` and the core layers load without the partitioner.
    if name in _EXPORTS:
        import importlib

        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'shardfn' has no attribute {name!r}")
