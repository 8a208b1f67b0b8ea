"""``sf.jit``: trace, annotate, propagate, lower and compile one function for a mesh.

    step = sf.jit(train_step, mesh=mesh, in_specs=(param_specs, opt_specs, P("dp")),
                  out_specs=(param_specs, opt_specs, P()), fsdp_argnums=(0,))
    lowered = step.lower(params, opt_state, batch)
    print(lowered.as_text()); lowered.comm_report(); lowered.memory_report()
    params, opt_state, metrics = step(params, opt_state, batch)
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
import warnings
from typing import Any, Callable, Mapping, Sequence

import optree
import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from shardfn.core._torch_private import dtensor_wrapper, local_shard_slices
from shardfn.partition.local_map import mesh_scope
from shardfn.partition.mesh import Mesh
from shardfn.partition.passes.bucket import functional_collectives
from shardfn.partition.passes.inplace import in_place_copy
from shardfn.partition.passes.points import PASS_POINTS, PassPipeline  # noqa: F401  (sf.jit's pass points)
from shardfn.partition.spec import broadcast_specs, check_divisible, is_auto, is_spec
from shardfn.partition.spmd import report
from shardfn.partition.spmd.lower import Lowered, lower
from shardfn.partition.spmd.trace import Traced, flatten_args, trace

log = logging.getLogger("shardfn.jit")


class LoweredStep:
    """A function traced and partitioned for one mesh and one input signature."""

    def __init__(self, traced: Traced, lowered: Lowered, mesh: Mesh, in_specs, out_specs, arg_roles,
                 grads_role: str | None = None, announce: Callable[[str], None] | None = None,
                 donated: Sequence[bool] = ()):
        self.traced = traced
        self.donated = tuple(donated)  # per input leaf: the uncompiled program may write over it
        self.lowered = lowered
        self.mesh = mesh
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.arg_roles = arg_roles
        self.grads_role = grads_role if grads_role is not None else ("params" if "params" in arg_roles else None)
        self.announce = announce or log.info
        self.name = "the function"
        self._compiled = None
        self._wrappers = None  # per output, built on the first call (_wrap_outputs)
        self._cuts: dict = {}  # (input leaf, global shape) -> this rank's slices of it (_to_local)
        # regions that communicate by themselves (an MoE exchange) record what they moved
        self.records = [r.records for r in traced.regions if r.records is not None]

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        """The per-rank program (local tensors in and out, functional collectives inside)."""
        return self.lowered.graph_module

    def as_text(self) -> str:
        """The global graph with each value's placements and each inserted collective."""
        return report.as_text(self.traced.graph_module, self.graph_module, self.mesh, self.traced.in_paths)

    def collectives(self) -> list[dict]:
        """Every collective in program order (op, axis, bytes, shape, source node)."""
        return report.collectives(self.graph_module, self.mesh)

    def comm_report(self) -> list[dict]:
        """Rows ``{op, axis, bytes, count}`` per step per rank. The all-to-alls of MoE layers,
        whose sizes depend on routing, run in the runtime: after a step has run they appear as
        one row per layer (``layer`` key) with the bytes that step moved."""
        rows = report.comm_report(self.graph_module, self.mesh)
        for records in self.records:
            rows += records.rows(self.mesh)
        return rows

    def memory_report(self) -> dict:
        """Bytes per rank: each named argument group (params, opt_state, ...; ``arg0``, ``arg1``
        without ``arg_names``), ``grads`` (the size of the parameters under their specs: the
        argument named ``params``, else the ``fsdp_argnums`` ones, else the first argument), and
        ``activations`` (peak bytes of the values the step creates)."""
        out: dict[str, int] = {}
        for meta, role in zip(self.lowered.local_in_meta, self.arg_roles):
            out[role] = out.get(role, 0) + meta.numel() * meta.element_size()
        grads_of = self.grads_role or (self.arg_roles[0] if self.arg_roles else None)
        if grads_of is not None:
            out["grads"] = sum(out.get(r, 0) for r in grads_of.split("+"))
        out["activations"] = report.peak_temporary_bytes(self.graph_module)
        out["total"] = sum(v for k, v in out.items() if k != "total")
        return out

    def compile(self, backend: str | None = "inductor") -> Callable:
        """The per-rank program compiled with torch.compile (``backend=None``: run as it is, its
        elementwise ops written in place where their input dies with them, ``partition.inplace``;
        the reports read :attr:`graph_module`, before that rewrite)."""
        if self._compiled is None or self._compiled[0] != backend:
            if backend is None:
                fn = in_place_copy(self.graph_module, self.donated)
            else:  # inductor takes no in-place collective (a bucket's all-reduce)
                fn = torch.compile(functional_collectives(self.graph_module), backend=backend, dynamic=False)
            self._compiled = (backend, fn)
        return self._compiled[1]

    def __call__(self, *args, backend: str | None = "inductor"):
        return self.call_flat(optree.tree_leaves(args, none_is_leaf=False), args, backend)

    def call_flat(self, leaves: list, args: tuple, backend: str | None = "inductor"):
        """``self(*args)`` from ``args``' leaves, flattened by the caller (once per call)."""
        for records in self.records:
            records.reset()  # this call's: the records neither pile up nor renumber layers
        if not all(isinstance(x, torch.Tensor) for x in leaves):
            flatten_args(args)  # raises, naming the leaf
        local = self._local(leaves)
        if backend is None and any(self.donated):
            self._check_donated(local)
        first = backend is not None and (self._compiled is None or self._compiled[0] != backend)
        start = time.perf_counter()
        program = self.compile(backend)
        if backend is None and any(x.requires_grad for x in local):  # autograd may keep what dies
            program = self.graph_module
        outs = program(*local)
        if first:  # torch.compile compiles on the first call
            self.announce(f"sf.jit: compiled {self.name} for {self.mesh} with {backend} and ran it once in "
                          f"{time.perf_counter() - start:.1f} s")
        return optree.tree_unflatten(self.traced.out_treedef, self._wrap_outputs(outs))

    def _check_donated(self, local: list[torch.Tensor]) -> None:
        """Two donated inputs in one memory would each be written as if it were its own."""
        seen: dict[int, int] = {}
        for i, (x, d) in enumerate(zip(local, self.donated)):
            if d and x.numel():
                j = seen.setdefault(x.untyped_storage().data_ptr(), i)
                if j != i:
                    paths = [".".join(filter(None, (self.arg_roles[k], self.traced.in_paths[k].partition(".")[2])))
                             for k in (j, i)]
                    raise ValueError(f"sf.jit donate_argnums: inputs {paths[0]} and {paths[1]} share one memory, "
                                     "and a donated input is written over; pass separate tensors (clone one) "
                                     "or leave that argument out of donate_argnums")

    def local_inputs(self, *args) -> list[torch.Tensor]:
        """``args``' leaves as the program takes them: this rank's local tensors.

            outs = lowered.graph_module(*lowered.local_inputs(params, opt_state, batch))
        """
        return self._local(optree.tree_leaves(args, none_is_leaf=False))

    def _local(self, leaves: list) -> list[torch.Tensor]:
        # a DTensor's local tensor without autograd's wrapper, where nothing needs a gradient
        grads = any(x.requires_grad for x in leaves)
        with contextlib.nullcontext() if grads else torch.no_grad():
            return [self._to_local(x, i) for i, x in enumerate(leaves)]

    def _to_local(self, x: torch.Tensor, i: int) -> torch.Tensor:
        """Input leaf ``i`` as this rank's local tensor under the lowered placements: a DTensor
        redistributed there (when it is not already) and unwrapped; a global tensor every rank
        holds cut to this rank's shard, no communication (the cut's slices kept per shape)."""
        placements = self.lowered.in_placements[i]
        if isinstance(x, DTensor):
            if tuple(x.placements) != tuple(placements):
                x = x.redistribute(self.mesh.device_mesh, placements)
            return x.to_local()
        key = (i, tuple(x.shape))
        cut = self._cuts.get(key, False)
        if cut is False:
            cut = self._cuts[key] = local_shard_slices(x.shape, self.mesh.device_mesh, placements)
        if cut is None:
            return distribute_tensor(x.detach(), self.mesh.device_mesh, placements, src_data_rank=None).to_local()
        return x.detach()[cut].contiguous()

    def _wrap_outputs(self, outs) -> list[DTensor]:
        """The program's local outputs as DTensors of the lowered placements and the traced
        global shapes; each output's DTensor spec is built on the first call and reused. An
        output with autograd history goes through ``DTensor.from_local``, which keeps the link."""
        dmesh, placements, metas = self.mesh.device_mesh, self.lowered.out_placements, self.traced.out_meta
        if self._wrappers is None:
            self._wrappers = [dtensor_wrapper(dmesh, pl, meta.shape, meta.stride(), o.dtype)
                              for o, pl, meta in zip(outs, placements, metas)]
        return [
            DTensor.from_local(o, dmesh, pl, run_check=False, shape=meta.shape, stride=meta.stride())
            if o.requires_grad else wrap(o)
            for o, wrap, pl, meta in zip(outs, self._wrappers, placements, metas)
        ]


class Jitted:
    """The callable ``sf.jit`` returns: lowers once per input signature, then runs compiled."""

    def __init__(self, fn, mesh, in_specs, out_specs, fsdp_argnums, fsdp_axes, backend, arg_names, memory_budget=None,
                 reshard_after_forward=True, passes=None, bucket_bytes=None, verbose=False, sequence_parallel=(),
                 donate_argnums=()):
        self.fn = fn
        self.donate_argnums = tuple(donate_argnums)
        self.mesh = mesh
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.fsdp_argnums = tuple(fsdp_argnums)
        self.fsdp_axes = tuple(fsdp_axes)
        self.backend = backend
        self.arg_names = arg_names
        self.memory_budget = memory_budget
        self.reshard_after_forward = reshard_after_forward
        self.passes = PassPipeline.of(passes, bucket_bytes=bucket_bytes)  # the defaults asked for, then the user's
        self.verbose = verbose
        self.sequence_parallel = _sequence_axes(sequence_parallel, mesh)
        self._cache: dict[Any, LoweredStep] = {}

    def programs(self) -> list[LoweredStep]:
        """The per-rank programs lowered so far, one per input signature, the first first.

            step(params, batch)
            print(step.programs()[0].as_text())
        """
        return list(self._cache.values())

    def lower(self, *args) -> LoweredStep:
        """Trace + annotate + propagate + insert collectives (no compile yet)."""
        key = _signature(args)
        if key in self._cache:
            return self._cache[key]
        start = time.perf_counter()
        step = self._lower(args)
        step.name = getattr(self.fn, "__name__", type(self.fn).__name__)
        step.announce = self.announce
        self.announce(f"sf.jit: lowered {step.name} for {self.mesh} in {time.perf_counter() - start:.1f} s "
                      f"({sum(r['count'] for r in step.comm_report())} collectives)")
        self._cache[key] = step
        return step

    def announce(self, line: str) -> None:
        """One line about a first call's lowering or compile: printed with ``verbose=True``, else
        logged at INFO on the ``shardfn.jit`` logger."""
        if self.verbose:
            print(line, file=sys.stderr, flush=True)
        else:
            log.info(line)

    def _lower(self, args) -> LoweredStep:
        args = _global_stand_ins(args)  # a first call may pass DTensors (a resumed run's, or a step's own outputs)
        with mesh_scope(self.mesh):
            traced = trace(self.fn, args)
        traced = self.passes.run("after_trace", traced)
        result = None
        if _has_auto(self.in_specs):  # the solver chooses the specs; every other option applies as without it
            from shardfn.partition import auto

            fixed = None if is_auto(self.in_specs) else self.in_specs
            options = auto_options(self.in_specs)
            result = auto.solve(traced, self.mesh, arg_names=self.arg_names, fixed_specs=fixed,
                                memory_budget=self.memory_budget, **options)
            warn_unproven(result)
            in_specs, out_specs = auto.apply(traced, result), list(result.out_specs)
            placements = result._problem._placements
        else:
            in_specs = broadcast_specs(self.in_specs, args, what="in_specs")
            out_tree = optree.tree_unflatten(traced.out_treedef, traced.out_meta)
            out_specs = broadcast_specs(self.out_specs, out_tree, what="out_specs")
            placements = self.mesh.placements
        in_placements = []
        for spec, meta, path in zip(in_specs, traced.in_meta, traced.in_paths):
            where = f"input {_pretty(path, self.arg_names)}"
            pl = placements(spec, meta.ndim, where=where)
            check_divisible(meta.shape, spec, self.mesh.axes, where=where)
            in_placements.append(pl)
        out_placements = []
        for i, (spec, meta) in enumerate(zip(out_specs, traced.out_meta)):
            where = f"output {i} {tuple(meta.shape)}"
            out_placements.append(placements(spec, meta.ndim, where=where))
            check_divisible(meta.shape, spec, self.mesh.axes, where=where)
        arg_of_leaf = _arg_index_of_leaves(args)
        stored = [i in self.fsdp_argnums for i in arg_of_leaf]
        roles = [self.arg_names[i] if self.arg_names else f"arg{i}" for i in arg_of_leaf]
        def lower_traced(traced):
            return lower(traced, self.mesh, in_placements, out_placements, stored=stored,
                         fsdp_axes=self.fsdp_axes, reuse_gathers=not self.reshard_after_forward,
                         sequence_parallel=self.sequence_parallel)

        lowered = lower_traced(traced)
        report.annotate_transitions(traced.graph_module, lowered.graph_module, self.mesh)
        if self.passes.at("after_propagate"):  # they read each node's meta["sf_placements"]
            before = traced.graph_module.code
            traced = self.passes.run("after_propagate", traced)
            if traced.graph_module.code != before:  # a rewrite: propagate and lower what it made
                lowered = lower_traced(traced)
        lowered.graph_module = self.passes.run("after_lower", traced, lowered.graph_module)
        grads_role = None if "params" in roles or not self.fsdp_argnums else "+".join(
            dict.fromkeys(r for r, i in zip(roles, arg_of_leaf) if i in self.fsdp_argnums))
        step = LoweredStep(traced, lowered, self.mesh, in_specs, out_specs, roles, grads_role or None,
                           donated=[i in self.donate_argnums for i in arg_of_leaf])
        if result is not None:
            step.auto = result  # the solver's choice: .to_rules_yaml(), .comparison_table(...)
        return step

    def __call__(self, *args):
        leaves, treedef = optree.tree_flatten(args, none_is_leaf=False)
        step = self._cache.get(_signature_of(treedef, leaves))
        if step is None:
            step = self.lower(*args)
        return step.call_flat(leaves, args, backend=self.backend)


def jit(
    fn: Callable,
    mesh: Mesh,
    in_specs: Any = None,
    out_specs: Any = None,
    *,
    fsdp_argnums: Sequence[int] = (),
    fsdp_axes: Sequence[str] = ("fsdp",),
    backend: str | None = "inductor",
    arg_names: Sequence[str] | None = None,
    memory_budget: float | None = None,
    reshard_after_forward: bool = True,
    passes: Mapping[str, Sequence[Callable]] | PassPipeline | None = None,
    bucket_bytes: int | None = None,
    verbose: bool = False,
    sequence_parallel: str | Sequence[str] = (),
    donate_argnums: Sequence[int] = (),
) -> Jitted:
    """Partition ``fn`` (a pure function of pytrees of tensors) over ``mesh``.

    Args:
        fn: the function; it may take gradients (``torch.func``) and update parameters inside.
        mesh: a ``shardfn.Mesh``.
        in_specs: a pytree of ``P`` that is a prefix of the argument tuple (None: replicated);
            ``sf.AUTO`` (or ``sf.AUTO(time_limit_s=..., mip_gap=..., hardware=..., cost_model=...,
            strict=...)``, ``partition.auto.solve``'s options) where the auto-sharder chooses. A plan
            not proven within ``mip_gap`` of the solver's bound warns (``strict=True``: raises).
        out_specs: a pytree of ``P`` that is a prefix of the outputs (None: replicated).
        fsdp_argnums: arguments stored sharded and all-gathered over ``fsdp_axes`` at each use
            (ZeRO-3); typically ``(0,)`` for the parameters of a train step.
        backend: the torch.compile backend for the per-rank program; None runs it uncompiled.
        arg_names: names of the arguments, used by reports (``("params", "opt_state", "batch")``).
        memory_budget: bytes per rank the auto-sharder must fit (``in_specs=sf.AUTO``, or AUTO
            leaves in it); default the hardware profile's device memory.
        reshard_after_forward: ``fsdp_argnums`` values are gathered again for the backward (True,
            less memory) or gathered once, the copy kept for the backward (False, half the bytes).
        passes: graph passes (``GraphModule -> GraphModule``) by point of the flow:
            ``after_trace`` (the global graph, e.g. ``partition.passes.remat.remat_pass("full")``),
            ``after_propagate`` (the global graph with ``meta["sf_placements"]`` on each node;
            a rewrite is propagated and lowered again) and ``after_lower`` (the per-rank program,
            collectives included). Each runs once per lowering, in order, after the default
            passes at its point (``partition/passes/points.py``, ``docs/passes.md``). A
            ``PassPipeline`` sets the defaults too (``remat``, ``overlap``).
        bucket_bytes: coalesce gradient all-reduces and reduce-scatters into buckets of at most
            this many bytes (``partition/passes/bucket.py``; the run config's ``partition.bucket_bytes``
            defaults to 25 MiB, as DDP); None or 0: one collective per tensor. Runs before the
            ``after_lower`` passes.
        verbose: print one line (to stderr) when a signature is first lowered and when its program
            is first compiled, with the seconds each took; else those lines go to the
            ``shardfn.jit`` logger at INFO (``logging.basicConfig(level=logging.INFO)`` shows them).
        sequence_parallel: mesh axes (``"tp"``) for Megatron sequence parallelism: a partial sum
            over them of an activation ``[batch, seq, ...]`` is reduce-scattered over its seq dim
            instead of all-reduced, so norms and residual adds run on ``1/tp`` of the tokens, and
            the gather before the next matmul is made once for all its consumers (``docs/context.md``).
        donate_argnums: arguments the caller gives up, as in ``jax.jit``: the uncompiled per-rank
            program (``backend=None``) writes values into their memory where the old value dies
            (a train step's new parameters and optimizer state, as ``torch.optim`` updates in
            place); the caller must not read them after the call. Inductor ignores it.

    Example:
        step = jit(lambda w, x: (x @ w).sum(), mesh, in_specs=(P(None, "tp"), P("dp")))
        loss = step(w, x)
    """
    if not isinstance(mesh, Mesh):
        raise TypeError(f"sf.jit: mesh must be a shardfn.Mesh, got {type(mesh).__name__} {mesh!r}; "
                        f"build one with sf.Mesh({{'dp': 2}}) (fake=True to plan in one process)")
    return Jitted(fn, mesh, in_specs, out_specs, fsdp_argnums, fsdp_axes, backend, arg_names, memory_budget,
                  reshard_after_forward, passes, bucket_bytes, verbose, sequence_parallel, donate_argnums)


def _sequence_axes(axes: str | Sequence[str], mesh: Mesh) -> tuple[str, ...]:
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    for a in axes:
        if a not in mesh.axes:
            raise ValueError(f"sf.jit sequence_parallel: unknown mesh axis {a!r}; the mesh has axes "
                             f"{tuple(mesh.axes)} (sequence parallelism splits over the tensor-parallel axis, 'tp')")
    return axes


def jit_auto(fn: Callable, mesh, args: tuple, *, arg_names: Sequence[str] | None = None, **solve_kwargs):
    """Trace ``fn(*args)``, solve, apply and lower: ``(lowered_step, result)``.

    ``lowered_step`` is the ``LoweredStep`` that ``sf.jit(...).lower(*args)`` returns (call it
    with the same arguments; ``backend=None`` runs it uncompiled). Keyword arguments go to
    :func:`solve`.

        step, result = jit_auto(train_step, mesh, (params, batch), memory_budget=8e9)
        new_params, loss = step(params, batch, backend=None)
    """
    from shardfn.partition import auto

    with mesh_scope(mesh):
        traced = trace(fn, tuple(args))
    result = auto.solve(traced, mesh, arg_names=arg_names, **solve_kwargs)
    warn_unproven(result)
    in_specs = auto.apply(traced, result)
    in_pl = [result._problem._placements(s, m.ndim, where="input") for s, m in zip(in_specs, traced.in_meta)]
    out_pl = [result._problem._placements(s, m.ndim, where="output") for s, m in zip(result.out_specs, traced.out_meta)]
    lowered = lower(traced, mesh, in_pl, out_pl)
    lowered.graph_module = PassPipeline().run("after_lower", traced, lowered.graph_module)
    roles = [arg_names[i] if arg_names else f"arg{i}" for i in _arg_index_of_leaves(tuple(args))]
    return LoweredStep(traced, lowered, mesh, in_specs, list(result.out_specs), roles), result


def _global_stand_ins(args) -> Any:
    """``args`` with each DTensor leaf as an uninitialized plain tensor of its global shape, for
    tracing (which reads only shapes and dtypes)."""
    def stand_in(x):
        return torch.empty(x.shape, dtype=x.dtype, device=x.device) if isinstance(x, DTensor) else x

    return optree.tree_map(stand_in, args, none_is_leaf=False)


def _has_auto(specs: Any) -> bool:
    return any(is_auto(s) for s in optree.tree_leaves(specs, is_leaf=is_spec, none_is_leaf=True))


def auto_options(specs: Any) -> dict:
    """The solver options of the ``sf.AUTO(...)`` leaves of ``specs`` (one set: leaves that name
    an option must agree on it).

        auto_options((sf.AUTO(time_limit_s=60), P("dp")))   # {"time_limit_s": 60}
    """
    options: dict = {}
    for leaf in optree.tree_leaves(specs, is_leaf=is_spec, none_is_leaf=True):
        if not is_auto(leaf):
            continue
        for key, value in leaf.options.items():
            if key in options and options[key] is not value and options[key] != value:
                raise ValueError(f"in_specs: sf.AUTO leaves disagree on {key}: {options[key]!r} and {value!r}; "
                                 f"give the solver's options once (every AUTO leaf shares one solve)")
            options[key] = value
    return options


def warn_unproven(result) -> None:
    """Warn (``UserWarning``, and the ``shardfn.jit`` logger) when the solver's plan is not proven
    within its ``mip_gap``; ``sf.AUTO(strict=True)`` raises in ``solve`` instead."""
    if result.proven:
        return
    log.warning(result.warning)
    warnings.warn(result.warning, UserWarning, stacklevel=4)


def _signature(args) -> tuple:
    leaves, treedef = optree.tree_flatten(args, none_is_leaf=False)
    return _signature_of(treedef, leaves)


def _signature_of(treedef, leaves) -> tuple:
    return (treedef, tuple((x.shape, x.dtype) if isinstance(x, torch.Tensor) else repr(x) for x in leaves))


def _arg_index_of_leaves(args: tuple) -> list[int]:
    out = []
    for i, a in enumerate(args):
        out.extend([i] * len(optree.tree_leaves(a, none_is_leaf=False)))
    return out


def _pretty(path: str, arg_names) -> str:
    head, _, rest = path.partition(".")
    if arg_names and head.isdigit() and int(head) < len(arg_names):
        head = arg_names[int(head)]
    return f"{head}.{rest}" if rest else head
