"""Functional optimizers in the style of optax.

A transform is a pair of pure functions, ``init(params) -> state`` and
``update(updates, state, params) -> (updates, new_state)``, bundled as a
:class:`GradientTransformation`. States are NamedTuples of tensors (pytrees), so a whole training
step -- forward, backward and optimizer -- is one pure function that ``make_fx``, ``torch.func`` and
``torch.compile`` can trace, and that the partitioner can shard: every state tree that mirrors the
parameters (``mu``, ``nu``) has exactly the parameters' tree structure.

Nothing here reads a tensor value on the host: no ``.item()``, no Python branching on tensors. The
step count lives in the state as a 0-d ``int32`` tensor on the parameters' device, and learning-rate
schedules are functions of that tensor.

    opt = adamw(warmup_cosine(3e-3, 10, 100, 0.1), weight_decay=0.1)
    state = opt.init(params)
    updates, state = opt.update(grads, state, params)
    params = apply_updates(params, updates)

Sign convention (as in optax): ``update`` returns the *step to add* to the parameters, so a
learning rate enters as ``-lr``.

Two forms of each update, chosen per call. Run eagerly (``core.transforms.eager``) on plain
tensors of one dtype and device, a transform works on the flat list of leaves with one
``torch._foreach_*`` kernel per list, as ``torch.optim``'s ``foreach`` implementations do, and
writes in place only into tensors it has just made; the step's inputs are never written.
Traced (``make_fx``, ``torch.compile``, the partitioner) or on DTensors, it is one op per leaf,
the graph the partitioner shards and the memory reports measure. Leaf by leaf it takes the same
ops in the same order as the eager form (``v`` as ``addcmul``, the decay as ``add(u, p,
alpha=wd)``, one rounding each as in ``torch.optim``), so the two agree bit for bit; they differ
only in the clipping norm, taken traced as ``sqrt(sum(x ** 2))`` (a sum the partitioner can
reduce over the mesh) and eagerly as the norm of the leaves' norms (as ``clip_grad_norm_``).

A train step calls :func:`update_and_apply`: eagerly, AdamW (masked or not, last in a chain)
then writes the new parameters as ``torch.optim.AdamW(foreach=True)`` does, ``p * (1 - lr *
wd)`` and one ``addcdiv``, with no update tree in between and the frozen leaves in no kernel
(equal to ``update`` then ``apply_updates`` up to float rounding; the moments to the bit).
Traced, it is exactly that pair.
"""

from __future__ import annotations

import math
import weakref
from typing import Any, Callable, NamedTuple, Union

import optree
import torch

from shardfn.core.pytree import PyTree, tree_flatten, tree_leaves, tree_map, tree_unflatten
from shardfn.core.transforms import eager

Schedule = Callable[[torch.Tensor], torch.Tensor]
"""A learning-rate schedule: ``step`` (0-d int tensor, 0 for the first update) -> 0-d tensor."""

ScalarOrSchedule = Union[float, Schedule]
MaskOrFn = Union[PyTree, Callable[[PyTree], PyTree], None]


class GradientTransformation(NamedTuple):
    """A pair of pure functions.

    Attributes:
        init: ``init(params) -> state``.
        update: ``update(updates, state, params=None) -> (new_updates, new_state)``.

    Example:
        opt = chain(clip_by_global_norm(1.0), adamw(1e-3))
        updates, state = opt.update(grads, opt.init(params), params)
    """

    init: Callable[[PyTree], Any]
    update: Callable[..., tuple[PyTree, Any]]


class EmptyState(NamedTuple):
    """The state of a stateless transform."""


class ScaleByAdamState(NamedTuple):
    count: torch.Tensor  # [] int32: number of updates applied so far
    mu: PyTree  # like params: first moment (EMA of gradients)
    nu: PyTree  # like params: second moment (EMA of squared gradients)


class ScaleByLearningRateState(NamedTuple):
    count: torch.Tensor  # [] int32: number of updates applied so far
    lr: torch.Tensor  # [] float32: the learning rate used by the most recent update


class ClipByGlobalNormState(NamedTuple):
    global_norm: torch.Tensor  # [] float32: L2 norm of the most recent incoming updates, pre-clip


# ----------------------------------------------------------------------------- helpers


def _first_device(tree: PyTree) -> torch.device:
    leaves = [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]
    return leaves[0].device if leaves else torch.device("cpu")


def _zero_count(params: PyTree) -> torch.Tensor:
    return torch.zeros((), dtype=torch.int32, device=_first_device(params))


def _lr_at(lr: ScalarOrSchedule, count: torch.Tensor) -> torch.Tensor:
    """The learning rate for the update that sees ``count`` previous updates, as a 0-d tensor."""
    if callable(lr):
        return torch.as_tensor(lr(count), dtype=torch.float32, device=count.device)
    return torch.full((), float(lr), dtype=torch.float32, device=count.device)


def _one_minus_pow(b: float, count: torch.Tensor) -> torch.Tensor:
    """``1 - b**count`` as ``-expm1(count * log b)``: exact to fp32 rounding even for b near 1."""
    return -torch.expm1(count.to(torch.float32) * math.log(b))


def _foreach(*lists: list) -> bool:
    """Whether to take the eager ``torch._foreach_*`` form over these lists of leaves: running
    eagerly, every leaf a plain tensor, all of one dtype and device."""
    first = next((xs[0] for xs in lists if xs), None)
    if first is None or not eager():
        return False
    dtype, device = first.dtype, first.device
    return all(type(x) is torch.Tensor and x.dtype == dtype and x.device == device for xs in lists for x in xs)


def _same_structure(tree: PyTree, treedef, what: str) -> list:
    """``tree``'s leaves, after checking it has the structure ``treedef``."""
    leaves, other = tree_flatten(tree)
    if other != treedef:
        raise ValueError(f"{what} has the structure {other}, not the parameters' {treedef}; pass trees of the "
                         "parameters' structure (and the state made by init for them).")
    return leaves


def global_norm(tree: PyTree) -> torch.Tensor:
    """The L2 norm of all leaves of ``tree`` together, as a 0-d float32 tensor.

    Traced, ``sqrt(sum(sum(x ** 2)))`` (a partitioned step reduces it over the mesh as a sum);
    eagerly, the norm of the leaves' norms (``torch._foreach_norm``, as ``clip_grad_norm_``
    takes it: no squared copy of any leaf). The two differ only by float rounding.

    Example:
        global_norm({"a": torch.tensor([3.0]), "b": torch.tensor([4.0])})  # tensor(5.)
    """
    leaves = [x for x in tree_leaves(tree) if isinstance(x, torch.Tensor)]
    if not leaves:
        return torch.zeros((), dtype=torch.float32)
    if _foreach(leaves):
        return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(leaves, 2, dtype=torch.float32)))
    squares = [torch.sum(torch.square(x.to(torch.float32))) for x in leaves]
    return torch.sqrt(torch.stack(squares).sum())


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """``params + updates`` leaf-wise, keeping each parameter's dtype.

    Example:
        updates, state = opt.update(grads, state, params)
        params = apply_updates(params, updates)
    """
    p, treedef = tree_flatten(params)
    u = _same_structure(updates, treedef, "apply_updates: updates")
    if _foreach(p, u):
        return tree_unflatten(treedef, torch._foreach_add(p, u))
    return tree_map(lambda p, u: p + u.to(p.dtype), params, updates)


def find_state(state: Any, cls: type) -> Any | None:
    """The first sub-state of type ``cls`` in a (possibly chained) optimizer state, or ``None``.

    Example:
        norm = find_state(opt_state, ClipByGlobalNormState).global_norm
    """
    if isinstance(state, cls):
        return state
    if isinstance(state, (tuple, list)):
        for sub in state:
            found = find_state(sub, cls)
            if found is not None:
                return found
    return None


# ----------------------------------------------------------------------------- schedules


def constant_schedule(value: float) -> Schedule:
    """``step -> value``.

    Example:
        constant_schedule(1e-3)(torch.tensor(5))  # tensor(0.0010)
    """

    def schedule(step):
        step = torch.as_tensor(step)
        return torch.full((), float(value), dtype=torch.float32, device=step.device)

    return schedule


def warmup_cosine(peak: float, warmup_steps: int, total_steps: int, min_ratio: float = 0.0) -> Schedule:
    """Linear warmup to ``peak``, then cosine decay to ``peak * min_ratio`` at ``total_steps``.

    ``lr(s) = peak * (s + 1) / warmup_steps`` for ``s < warmup_steps`` (the first update already
    moves; the last warmup step is at ``peak``), then with ``t = (s - warmup_steps) /
    (total_steps - warmup_steps)`` clipped to ``[0, 1]``:
    ``lr(s) = min + (peak - min) * (1 + cos(pi * t)) / 2`` with ``min = peak * min_ratio``.

    Args:
        peak: the learning rate at the end of warmup.
        warmup_steps: number of warmup steps (0 for none).
        total_steps: the step at which the decay reaches ``peak * min_ratio`` (usually the run's
            total number of steps, warmup included).
        min_ratio: final learning rate as a fraction of ``peak``.

    Returns:
        A :data:`Schedule`: a traceable function of a 0-d integer tensor (ints work too).

    Example:
        lr = warmup_cosine(1.0, warmup_steps=2, total_steps=6, min_ratio=0.0)
        [round(float(lr(s)), 3) for s in range(7)]  # [0.5, 1.0, 1.0, 0.854, 0.5, 0.146, 0.0]
    """
    if warmup_steps < 0 or total_steps < 0:
        raise ValueError(f"warmup_steps ({warmup_steps}) and total_steps ({total_steps}) must be >= 0")
    if not 0.0 <= min_ratio <= 1.0:
        raise ValueError(f"min_ratio must be in [0, 1], got {min_ratio}")
    floor = peak * min_ratio
    decay_steps = max(total_steps - warmup_steps, 1)

    def schedule(step):
        s = torch.as_tensor(step).to(torch.float32)
        warm = peak * (s + 1.0) / max(warmup_steps, 1)
        t = torch.clamp((s - warmup_steps) / decay_steps, 0.0, 1.0)
        cosine = floor + (peak - floor) * 0.5 * (1.0 + torch.cos(math.pi * t))
        return torch.where(s < warmup_steps, warm, cosine)

    return schedule


# ----------------------------------------------------------------------------- transforms


_FUSED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
"""``transform.update -> fused(updates, state, params, donate)``: the transforms whose update and
:func:`apply_updates` have a fused eager form (see :func:`update_and_apply`)."""


def update_and_apply(opt: GradientTransformation, updates: PyTree, state: Any, params: PyTree, *,
                     donate: bool = False) -> tuple[PyTree, Any]:
    """``(apply_updates(params, u), state)`` for ``u, state = opt.update(updates, state, params)``.

    Eagerly, on plain tensors of one dtype and device, a transform that has a fused form
    (:func:`adamw`, masked or not, last in a :func:`chain`) computes the new parameters as
    ``torch.optim.AdamW(foreach=True)`` does: ``p * (1 - lr * wd)``, then one ``addcdiv`` of
    the moments, with no update tree in between (two passes over the parameters and two
    parameter-sized tensors fewer), and with a mask, the frozen leaves never enter a kernel.
    Its values are ``torch.optim``'s and may differ from ``update`` then ``apply_updates`` in
    the last bit. Traced, on DTensors, or for any other transform: exactly that pair.

    ``donate=True`` gives the call ``params``, ``state`` and ``updates`` to write into, as JAX's
    ``donate_argnums`` does: the fused form then updates the parameters and moments in their own
    memory, as ``torch.optim`` does, with the same kernels and bits, and returns those tensors. The
    caller must not read the old values afterwards (a training loop that keeps only the new state).
    Elsewhere it changes nothing.

    Example:
        params, state = update_and_apply(adamw(1e-3), grads, state, params)
        params, state = update_and_apply(adamw(1e-3), grads, state, params, donate=True)  # in place
    """
    if eager():  # a look-up torch.compile need not trace: traced, it is the pair below
        fused = _FUSED.get(opt.update)
        out = fused(updates, state, params, donate) if fused is not None else None
        if out is not None:
            return out
    updates, state = opt.update(updates, state, params)
    return apply_updates(params, updates), state


def _check_adam_state(state, who: str) -> None:
    if not isinstance(state, ScaleByAdamState):
        raise TypeError(f"{who} got state {type(state).__name__}; make sure you passed "
                        "the state returned by this transform's init (or by the chain's init).")


def _adam_foreach(updates: PyTree, state: ScaleByAdamState, b1: float, b2: float, eps: float):
    """:func:`scale_by_adam`'s update in the eager ``foreach`` form: ``(direction, new state,
    treedef)``, ``direction`` a list of tensors made here (its caller's to scale in place); None
    where that form does not apply (traced, DTensors, mixed dtypes)."""
    mu, treedef = tree_flatten(state.mu)
    nu = _same_structure(state.nu, treedef, "scale_by_adam: state.nu")
    g = _same_structure(updates, treedef, "scale_by_adam: updates")
    if not _foreach(mu, nu, g):
        return None
    count = state.count + 1
    mu = torch._foreach_lerp(mu, g, 1.0 - b1)                       # m <- b1 m + (1 - b1) g
    nu = torch._foreach_mul(nu, b2)
    torch._foreach_addcmul_(nu, g, g, value=1.0 - b2)               # v <- b2 v + (1 - b2) g^2
    denom = torch._foreach_sqrt(nu)
    torch._foreach_div_(denom, torch.sqrt(_one_minus_pow(b2, count)).to(nu[0].dtype))
    torch._foreach_add_(denom, eps)                                 # sqrt(v) / sqrt(1 - b2^t) + eps
    direction = torch._foreach_div(mu, _one_minus_pow(b1, count).to(mu[0].dtype))
    torch._foreach_div_(direction, denom)                           # (m / (1 - b1^t)) / denom
    return direction, ScaleByAdamState(count, tree_unflatten(treedef, mu), tree_unflatten(treedef, nu)), treedef


def scale_by_adam(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam's preconditioning: ``m_hat / (sqrt(v_hat) + eps)`` with bias correction.

    Follows ``torch.optim.Adam``: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``,
    ``update = (m / (1 - b1^t)) / (sqrt(v) / sqrt(1 - b2^t) + eps)`` at step ``t = 1, 2, ...``.
    Moments have the parameters' dtype and tree structure.

    Example:
        opt = chain(scale_by_adam(), scale_by_learning_rate(1e-3))
        updates, state = opt.update(grads, opt.init(params))
    """
    if not (0.0 <= b1 < 1.0 and 0.0 <= b2 < 1.0):
        raise ValueError(f"betas must be in [0, 1), got b1={b1}, b2={b2}")

    def init(params):
        zeros = lambda p: torch.zeros_like(p)  # noqa: E731
        return ScaleByAdamState(_zero_count(params), tree_map(zeros, params), tree_map(zeros, params))

    def update(updates, state, params=None):
        del params
        _check_adam_state(state, "scale_by_adam")
        eager_update = _adam_foreach(updates, state, b1, b2, eps)
        if eager_update is not None:
            direction, state, treedef = eager_update
            return tree_unflatten(treedef, direction), state
        count = state.count + 1
        mu = tree_map(lambda m, g: torch.lerp(m, g.to(m.dtype), 1.0 - b1), state.mu, updates)
        nu = tree_map(lambda v, g: torch.addcmul(v * b2, g.to(v.dtype), g.to(v.dtype), value=1.0 - b2),
                      state.nu, updates)  # as the eager form: one rounding for b2 v + (1 - b2) g^2
        bc1 = _one_minus_pow(b1, count)
        bc2_sqrt = torch.sqrt(_one_minus_pow(b2, count))
        new = tree_map(lambda m, v: (m / bc1.to(m.dtype)) / (torch.sqrt(v) / bc2_sqrt.to(v.dtype) + eps), mu, nu)
        return new, ScaleByAdamState(count, mu, nu)

    return GradientTransformation(init, update)


def add_decayed_weights(weight_decay: float) -> GradientTransformation:
    """``updates + weight_decay * params`` (decoupled weight decay when placed before the lr).

    Example:
        opt = chain(scale_by_adam(), add_decayed_weights(0.1), scale_by_learning_rate(1e-3))
        updates, state = opt.update(grads, opt.init(params), params)
    """

    def init(params):
        del params
        return EmptyState()

    def update(updates, state, params=None):
        if weight_decay == 0.0:
            return updates, state
        if params is None:
            raise ValueError("add_decayed_weights needs the parameters: call update(grads, state, params).")
        u, treedef = tree_flatten(updates)
        p = _same_structure(params, treedef, "add_decayed_weights: params")
        if _foreach(u, p):
            return tree_unflatten(treedef, torch._foreach_add(u, p, alpha=weight_decay)), state
        return tree_map(lambda u, p: torch.add(u, p.to(u.dtype), alpha=weight_decay), updates, params), state

    return GradientTransformation(init, update)


def scale_by_learning_rate(lr: ScalarOrSchedule) -> GradientTransformation:
    """``-lr * updates``; ``lr`` is a float or a :data:`Schedule` of the update count.

    The state records the learning rate the latest update used (``state.lr``), for logging.

    Example:
        opt = chain(scale_by_adam(), scale_by_learning_rate(warmup_cosine(1e-3, 10, 100)))
        updates, state = opt.update(grads, opt.init(params))
    """

    def init(params):
        count = _zero_count(params)
        return ScaleByLearningRateState(count, _lr_at(lr, count))

    def update(updates, state, params=None):
        del params
        step_lr = _lr_at(lr, state.count)
        u, treedef = tree_flatten(updates)
        if _foreach(u):
            new = tree_unflatten(treedef, torch._foreach_mul(u, -step_lr.to(u[0].dtype)))
        else:
            new = tree_map(lambda u: -step_lr.to(u.dtype) * u, updates)
        return new, ScaleByLearningRateState(state.count + 1, step_lr)

    return GradientTransformation(init, update)


def clip_by_global_norm(max_norm: float, *, norm: Callable[[PyTree], torch.Tensor] = global_norm
                        ) -> GradientTransformation:
    """Scale all updates by ``min(1, max_norm / (norm + 1e-6))``, like ``clip_grad_norm_``.

    ``norm(updates)`` is the L2 norm over all leaves together (:func:`global_norm`); where the
    updates are this rank's part of a larger tree (a pipeline stage's slices), pass the function
    that adds the other ranks' parts. The state records the norm (before clipping) as
    ``state.global_norm``, e.g. for logging ``grad_norm``.

    Example:
        clipped, state = clip_by_global_norm(1.0).update(grads, EmptyState())
        state.global_norm  # the norm of grads
    """
    if max_norm <= 0:
        raise ValueError(f"max_norm must be > 0, got {max_norm}; leave clipping out of the chain to disable it.")

    def init(params):
        return ClipByGlobalNormState(torch.zeros((), dtype=torch.float32, device=_first_device(params)))

    def update(updates, state, params=None):
        del state, params
        total = norm(updates)
        scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        u, treedef = tree_flatten(updates)
        if _foreach(u):
            return tree_unflatten(treedef, torch._foreach_mul(u, scale.to(u[0].dtype))), ClipByGlobalNormState(total)
        return tree_map(lambda u: u * scale.to(u.dtype), updates), ClipByGlobalNormState(total)

    return GradientTransformation(init, update)


def chain(*transforms: GradientTransformation) -> GradientTransformation:
    """Apply transforms in sequence; the state is the tuple of their states.

    Example:
        opt = chain(clip_by_global_norm(1.0), scale_by_adam(), scale_by_learning_rate(1e-3))
        state = opt.init(params)  # (ClipByGlobalNormState, ScaleByAdamState, ScaleByLearningRateState)
    """

    def init(params):
        return tuple(t.init(params) for t in transforms)

    def update(updates, state, params=None):
        if not isinstance(state, tuple) or len(state) != len(transforms):
            raise ValueError(f"chain of {len(transforms)} transforms got a state of type "
                             f"{type(state).__name__}; pass the state returned by this chain's init.")
        new_states = []
        for t, s in zip(transforms, state):
            updates, s = t.update(updates, s, params)
            new_states.append(s)
        return updates, tuple(new_states)

    def fused(updates, state, params, donate=False):
        if not isinstance(state, tuple) or len(state) != len(transforms) or _FUSED.get(transforms[-1].update) is None:
            return None
        new_states = []
        for t, s in zip(transforms[:-1], state[:-1]):
            updates, s = t.update(updates, s, params)
            new_states.append(s)
        params, s = update_and_apply(transforms[-1], updates, state[-1], params, donate=donate)
        return params, tuple(new_states) + (s,)

    chained = GradientTransformation(init, update)
    if transforms and transforms[-1].update in _FUSED:
        _FUSED[chained.update] = fused
    return chained


def masked(inner: GradientTransformation, mask: MaskOrFn) -> GradientTransformation:
    """Apply ``inner`` only where ``mask`` is True; leaves where it is False get a zero update.

    Masked-off leaves are left exactly untouched (no step, no weight decay), and ``inner`` sees a
    zero gradient for them so its statistics stay zero. The state keeps the parameters' full tree
    structure, so specs that address parameters address their optimizer state too. Only
    the masked-off leaves cost anything (with every leaf selected this is ``inner`` itself).

    Args:
        inner: the transform to apply to the selected leaves.
        mask: a tree of Python bools with the parameters' structure, or a function
            ``params -> such a tree``. Static: it is read at trace time, never as a tensor.

    Example:
        mask = {"w": True, "router_bias": False}
        opt = masked(adamw(1e-3), mask)
    """

    def resolve(params):
        m = mask(params) if callable(mask) else mask
        bad = [x for x in tree_leaves(m) if not isinstance(x, bool)]
        if bad:
            raise TypeError(f"mask leaves must be Python bools (static), got {type(bad[0]).__name__}; "
                            "build the mask with map_with_path(lambda path, x: ..., params).")
        return m

    def init(params):
        return inner.init(params)

    def update(updates, state, params=None):
        if params is None:
            raise ValueError("masked(...) needs the parameters to resolve its mask: call update(grads, state, params).")
        m = resolve(params)
        u, treedef = tree_flatten(updates)
        keep = tree_leaves(optree.tree_broadcast_prefix(m, updates, none_is_leaf=False))
        if all(keep):  # no pass at all where the mask is on everywhere
            return inner.update(updates, state, params)
        zeros = [None if k else torch.zeros_like(x) for k, x in zip(keep, u)]  # only where it is off
        chosen = tree_unflatten(treedef, [x if k else z for k, x, z in zip(keep, u, zeros)])
        new, state = inner.update(chosen, state, params)
        return tree_unflatten(treedef, [x if k else z for k, x, z in zip(keep, tree_leaves(new), zeros)]), state

    return GradientTransformation(init, update)


# ----------------------------------------------------------------------------- aliases


def adamw(
    lr: ScalarOrSchedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    mask: MaskOrFn = None,
) -> GradientTransformation:
    """AdamW (Loshchilov & Hutter, 2019) exactly as ``torch.optim.AdamW``.

    ``p <- p - lr * (m_hat / (sqrt(v_hat) + eps) + weight_decay * p)``: bias-corrected Adam plus
    weight decay decoupled from the gradient statistics and scaled by the (scheduled) learning rate.

    Args:
        lr: a float, or a schedule ``step -> lr`` evaluated at the number of previous updates
            (0 for the first), like a ``torch.optim.lr_scheduler.LambdaLR`` stepped after each update.
        b1, b2: exponential decay rates of the first and second moments.
        eps: added to ``sqrt(v_hat)`` for numerical stability.
        weight_decay: decoupled weight-decay coefficient.
        mask: optional tree of bools (or ``params -> tree``); leaves marked False are left untouched
            (no update and no decay), e.g. the MoE router's selection bias.

    Example:
        opt = adamw(warmup_cosine(3e-3, 10, 100, 0.1), b2=0.95, weight_decay=0.1)
        updates, state = opt.update(grads, opt.init(params), params)
    """
    opt = _adamw(lr, b1, b2, eps, weight_decay)
    if mask is None:
        return opt
    out = masked(opt, mask)
    _FUSED[out.update] = _adamw_fused(lr, b1, b2, eps, weight_decay, mask)
    return out


def _adamw_fused(lr: ScalarOrSchedule, b1: float, b2: float, eps: float, weight_decay: float,
                 mask: MaskOrFn = None) -> Callable:
    """AdamW's update and :func:`apply_updates` as one eager ``foreach`` pass, written as
    ``torch.optim.AdamW(foreach=True)`` writes it (:func:`update_and_apply`). Leaves ``mask``
    turns off are left out of every kernel: their parameters and moments come back as they
    went in. None where it does not apply (the caller then runs the update and applies it)."""
    keeps: dict = {}

    def keep_of(params, treedef):
        if mask is None:
            return None
        if treedef not in keeps:  # static: resolved once per tree structure
            m = mask(params) if callable(mask) else mask
            leaves = tree_leaves(optree.tree_broadcast_prefix(m, params, none_is_leaf=False))
            keeps[treedef] = leaves if all(isinstance(k, bool) for k in leaves) else False  # masked() explains
        return keeps[treedef]

    def fused(updates, state, params, donate=False):
        if not (isinstance(state, tuple) and len(state) == 3 and isinstance(state[0], ScaleByAdamState)):
            return None
        adam_state, decay_state, lr_state = state
        mu, treedef = tree_flatten(adam_state.mu)
        p, _ = tree_flatten(params)
        g, gdef = tree_flatten(updates)
        nu, ndef = tree_flatten(adam_state.nu)
        if gdef != treedef or ndef != treedef or len(p) != len(mu):
            return None
        keep = keep_of(params, treedef)
        if keep is False:
            return None
        idx = [i for i, k in enumerate(keep) if k] if keep is not None else list(range(len(p)))
        pick = lambda xs: [xs[i] for i in idx]  # noqa: E731
        p_k, g_k, mu_k, nu_k = pick(p), pick(g), pick(mu), pick(nu)
        if not idx or not _foreach(p_k, g_k, mu_k, nu_k):
            return None
        count = adam_state.count + 1
        step_lr = _lr_at(lr, lr_state.count)
        dtype = p_k[0].dtype
        decay = (1.0 - step_lr * weight_decay).to(dtype)
        # m <- b1 m + (1 - b1) g, the first factor of v and the decoupled decay; donated, in the
        # caller's memory with torch.optim's in-place kernels (the same values)
        if donate:
            torch._foreach_lerp_(mu_k, g_k, 1.0 - b1)
            torch._foreach_mul_(nu_k, b2)
            torch._foreach_mul_(p_k, decay)
            new_p = p_k
        else:
            mu_k = torch._foreach_lerp(mu_k, g_k, 1.0 - b1)
            nu_k = torch._foreach_mul(nu_k, b2)
            new_p = torch._foreach_mul(p_k, decay)
        torch._foreach_addcmul_(nu_k, g_k, g_k, value=1.0 - b2)                  # v <- b2 v + (1 - b2) g^2
        denom = torch._foreach_sqrt(nu_k)
        torch._foreach_div_(denom, torch.sqrt(_one_minus_pow(b2, count)).to(dtype))
        torch._foreach_add_(denom, eps)                                           # sqrt(v) / sqrt(1 - b2^t) + eps
        step = (-step_lr / _one_minus_pow(b1, count)).to(dtype)
        # - lr / (1 - b1^t) * m / denom; the kernel reads its scalars on the host, as torch.optim's
        # non-capturable AdamW computes them there (on a GPU, one copy of a 0-d tensor a step)
        torch._foreach_addcdiv_(new_p, mu_k, denom, step.cpu().repeat(len(idx)))
        p, mu, nu = list(p), list(mu), list(nu)
        for j, i in enumerate(idx):
            p[i], mu[i], nu[i] = new_p[j], mu_k[j], nu_k[j]
        state = (ScaleByAdamState(count, tree_unflatten(treedef, mu), tree_unflatten(treedef, nu)), decay_state,
                 ScaleByLearningRateState(lr_state.count + 1, step_lr))
        return tree_unflatten(treedef, p), state

    return fused


def _adamw(lr: ScalarOrSchedule, b1: float, b2: float, eps: float, weight_decay: float) -> GradientTransformation:
    """``chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay),
    scale_by_learning_rate(lr))``: that chain's init, state and values to the bit. Eagerly, the
    decay and the learning rate scale the Adam direction in place, the direction being a tensor
    this update has just made: two full-size tensors per leaf fewer than the chain makes."""
    chained = chain(scale_by_adam(b1, b2, eps), add_decayed_weights(weight_decay), scale_by_learning_rate(lr))

    def eager_update(updates, state, params):
        """The eager form's ``(updates, state)``, or None where the chain's update runs instead
        (traced, DTensors, mixed dtypes, or a mistake the chain's error explains)."""
        if not (isinstance(state, tuple) and len(state) == 3 and isinstance(state[0], ScaleByAdamState)):
            return None
        if weight_decay != 0.0 and params is None:
            return None
        adam_state, decay_state, lr_state = state
        adam = _adam_foreach(updates, adam_state, b1, b2, eps)
        if adam is None:
            return None
        direction, adam_state, treedef = adam
        if weight_decay != 0.0:
            p = _same_structure(params, treedef, "adamw: params")
            if not _foreach(direction, p):
                return None
            torch._foreach_add_(direction, p, alpha=weight_decay)                  # + wd * p
        step_lr = _lr_at(lr, lr_state.count)
        torch._foreach_mul_(direction, -step_lr.to(direction[0].dtype))            # * -lr
        state = (adam_state, decay_state, ScaleByLearningRateState(lr_state.count + 1, step_lr))
        return tree_unflatten(treedef, direction), state

    def update(updates, state, params=None):
        out = eager_update(updates, state, params)
        return chained.update(updates, state, params) if out is None else out

    opt = GradientTransformation(chained.init, update)
    _FUSED[opt.update] = _adamw_fused(lr, b1, b2, eps, weight_decay)
    return opt


def adam(lr: ScalarOrSchedule, b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8) -> GradientTransformation:
    """Adam (Kingma & Ba, 2015) as ``torch.optim.Adam`` without weight decay.

    Example:
        opt = adam(1e-3)
        updates, state = opt.update(grads, opt.init(params))
    """
    return chain(scale_by_adam(b1, b2, eps), scale_by_learning_rate(lr))
