"""shardfn: JAX-style functional PyTorch.

Models are pure functions over parameter pytrees; a partitioner turns one traced training step
into per-rank programs for a named device mesh.

    import shardfn as sf
    from shardfn import P
    mesh = sf.Mesh({"dp": 2, "tp": 2})
    step = sf.jit(train_step, mesh=mesh, in_specs=(param_specs, P("dp")), out_specs=(param_specs, P()))
"""

__version__ = "0.1.0"

from shardfn.partition.spec import P, AUTO  # noqa: E402
from shardfn.partition.mesh import Mesh  # noqa: E402
from shardfn.partition.constrain import constrain, local_map  # noqa: E402
from shardfn.partition.api import jit  # noqa: E402

__all__ = ["P", "AUTO", "Mesh", "constrain", "local_map", "jit", "__version__"]
