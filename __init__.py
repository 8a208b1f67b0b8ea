"""shardfn: JAX-style functional PyTorch.

Models are pure functions over parameter pytrees; a partitioner turns one traced training step
into per-rank programs for a named device mesh. Everything a program of your own needs is one
namespace:

    import shardfn as sf
    from shardfn import P

    opt = sf.optim.adamw(1e-3)

    def train_step(params, opt_state, batch):
        loss, grads = sf.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return sf.optim.apply_updates(params, updates), opt_state, loss

    mesh = sf.Mesh({"dp": 2, "tp": 2})
    step = sf.jit(train_step, mesh, in_specs=(param_specs, opt_specs, P("dp")),
                  out_specs=(param_specs, opt_specs, P()))

Names, by what they are for (each is imported on first use, so ``import shardfn`` loads neither
torch nor the partitioner):

- partitioning: ``jit``, ``P``, ``AUTO``, ``Mesh``, ``specs_like``, ``constrain``, ``local_map``,
  ``pipeline_split``, ``register_autograd``;
- transforms: ``value_and_grad``, ``grad``, ``stop_gradient``;
- optimizers: ``optim`` (optax-style ``(init, update)`` pairs, ``chain``, ``adamw``, schedules);
- activation checkpointing: ``remat`` (alias ``checkpoint``) over a function, ``remat_pass``
  over a traced graph, and ``checkpoint_policies``, the policies both take;
- mixed precision: ``with_policy``, ``PrecisionPolicy`` and ``precision_policy`` (a config's
  ``train.precision`` -> its ``PrecisionPolicy``). "Policy" alone means nothing here: a remat
  policy says what to save, a precision policy which dtypes to compute in.
"""

__version__ = "0.1.0"

_EXPORTS = {
    # name in sf -> (module, attribute in it; None: the module itself)
    "jit": ("shardfn.partition.api", "jit"),
    "P": ("shardfn.partition.spec", "P"),
    "AUTO": ("shardfn.partition.spec", "AUTO"),
    "specs_like": ("shardfn.partition.spec", "specs_like"),
    "Mesh": ("shardfn.partition.mesh", "Mesh"),
    "constrain": ("shardfn.partition.constrain", "constrain"),
    "local_map": ("shardfn.partition.local_map", "local_map"),
    "pipeline_split": ("shardfn.partition.constrain", "pipeline_split"),
    "register_autograd": ("shardfn.core.custom_ops", "register_autograd"),
    "value_and_grad": ("shardfn.core.transforms", "value_and_grad"),
    "grad": ("shardfn.core.transforms", "grad"),
    "stop_gradient": ("shardfn.core.transforms", "stop_gradient"),
    "optim": ("shardfn.core.optim", None),
    "remat": ("shardfn.partition.passes.remat", "rematerialized"),
    "checkpoint": ("shardfn.partition.passes.remat", "rematerialized"),
    "remat_pass": ("shardfn.partition.passes.remat", "remat_pass"),
    "with_policy": ("shardfn.core.precision", "with_policy"),
    "PrecisionPolicy": ("shardfn.core.precision", "Policy"),
    "precision_policy": ("shardfn.core.precision", "get_policy"),
}

__all__ = [*_EXPORTS, "checkpoint_policies", "__version__"]


class _CheckpointPolicies:
    """The policies ``sf.remat`` / ``sf.checkpoint`` and ``sf.remat_pass`` take (and
    ``train.remat`` names), in the spirit of ``jax.checkpoint_policies``:

    - ``none``: save every forward value the backward reads (no recomputation);
    - ``full``: save only what crosses from one layer into the next; each layer is recomputed;
    - ``selective``: ``full`` plus the outputs of matmuls and attention;
    - ``saves_matmuls``: ``selective``'s predicate; any ``fx.Node -> bool`` predicate of your
      own names what to save besides the layer boundaries.

    Example:
        step = sf.remat(train_step, sf.checkpoint_policies.selective)
    """

    none = "none"
    full = "full"
    selective = "selective"

    @property
    def saves_matmuls(self):
        from shardfn.partition.passes.remat import saves_matmuls

        return saves_matmuls

    def __repr__(self) -> str:
        return "sf.checkpoint_policies(none, full, selective, saves_matmuls)"


def __getattr__(name):
    # Imported on first use, so `import shardfn` and `shardfn params` load no partitioner.
    if name == "checkpoint_policies":
        value = _CheckpointPolicies()
    elif name in _EXPORTS:
        import importlib

        module, attr = _EXPORTS[name]
        value = importlib.import_module(module)
        if attr is not None:
            value = getattr(value, attr)
    else:
        raise AttributeError(f"module 'shardfn' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted({*globals(), *__all__})
