"""Functional optimizers and transforms against torch.optim / torch.nn.utils / hand-computed values."""

import math

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from shardfn.core import optim
from shardfn.core.pytree import flatten_with_paths, tree_leaves, tree_map
from shardfn.core.transforms import eager, grad, stop_gradient, value_and_grad


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(7, 5, generator=g),
        "layers": {"w": torch.randn(2, 5, 3, generator=g), "norm": torch.randn(2, 5, generator=g)},
        "bias": torch.randn(3, generator=g),
    }


def _grads(step, like):
    g = torch.Generator().manual_seed(100 + step)
    return tree_map(lambda p: torch.randn(p.shape, generator=g), like)


def _run_functional(opt, params, steps, jit=False):
    state = opt.init(params)
    update = torch.compile(opt.update) if jit else opt.update
    for step in range(steps):
        updates, state = update(_grads(step, params), state, params)
        params = optim.apply_updates(params, updates)
    return params, state


def _run_torch(params, steps, make_opt, schedule=None):
    flat = {k: v.clone().requires_grad_(True) for k, v in _flat(params).items()}
    opt = make_opt(list(flat.values()))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule) if schedule else None
    for step in range(steps):
        for k, g in _flat(_grads(step, params)).items():
            flat[k].grad = g
        opt.step()
        if sched:
            sched.step()
    return {k: v.detach() for k, v in flat.items()}


def _flat(tree):
    return dict(flatten_with_paths(tree))


def _assert_close(ours, theirs, atol=1e-6):
    ours = _flat(ours)
    assert ours.keys() == theirs.keys()
    for k in ours:
        torch.testing.assert_close(ours[k], theirs[k], atol=atol, rtol=0, msg=k)


# ----------------------------------------------------------------------------- AdamW


@pytest.mark.parametrize("jit", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_matches_torch(jit, wd):
    params = _params()
    lr, b1, b2, eps = 1e-2, 0.9, 0.95, 1e-8
    ours, state = _run_functional(optim.adamw(lr, b1, b2, eps, weight_decay=wd), params, 5, jit=jit)
    theirs = _run_torch(params, 5, lambda ps: torch.optim.AdamW(ps, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd))
    _assert_close(ours, theirs)
    adam_state = optim.find_state(state, optim.ScaleByAdamState)
    assert adam_state.count.dtype == torch.int32 and int(adam_state.count) == 5


def test_adamw_with_schedule_matches_lambda_lr():
    params = _params(1)
    peak, sched = 3e-2, optim.warmup_cosine(3e-2, warmup_steps=2, total_steps=5, min_ratio=0.1)
    ours, state = _run_functional(optim.adamw(sched, 0.9, 0.999, 1e-8, weight_decay=0.05), params, 5)
    theirs = _run_torch(
        params,
        5,
        lambda ps: torch.optim.AdamW(ps, lr=peak, weight_decay=0.05),
        schedule=lambda s: float(sched(s)) / peak,
    )
    _assert_close(ours, theirs)
    # The state records the lr of the latest update (step 4 of a 5-step schedule).
    lr_state = optim.find_state(state, optim.ScaleByLearningRateState)
    assert float(lr_state.lr) == pytest.approx(float(sched(4)))


def test_adamw_bias_correction_first_step_is_sign_times_lr():
    # After one step m_hat = g and v_hat = g^2, so the update is -lr * g / (|g| + eps).
    params = {"w": torch.zeros(4)}
    grads = {"w": torch.tensor([1e-3, -2.0, 30.0, -4e4])}
    updates, _ = optim.adamw(0.5, b1=0.9, b2=0.999, eps=0.0, weight_decay=0.0).update(
        grads, optim.adamw(0.5).init(params), params
    )
    torch.testing.assert_close(updates["w"], -0.5 * torch.sign(grads["w"]))


def test_mask_leaves_untouched_and_others_match_torch():
    params = _params(2)
    mask = {"embed": True, "layers": {"w": True, "norm": False}, "bias": False}
    ours, state = _run_functional(optim.adamw(1e-2, weight_decay=0.1, mask=mask), params, 5)
    assert torch.equal(ours["layers"]["norm"], params["layers"]["norm"])
    assert torch.equal(ours["bias"], params["bias"])
    # Statistics of masked-off leaves stay zero; the state keeps the params' structure.
    adam_state = optim.find_state(state, optim.ScaleByAdamState)
    assert torch.count_nonzero(adam_state.nu["bias"]) == 0
    assert tree_map(lambda x: x.shape, adam_state.mu) == tree_map(lambda x: x.shape, params)
    theirs = _run_torch(params, 5, lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1))
    for k in ("embed", "layers.w"):
        torch.testing.assert_close(_flat(ours)[k], theirs[k], atol=1e-6, rtol=0)


def test_mask_as_function_of_params():
    params = {"w": torch.ones(3), "router_bias": torch.ones(3)}
    opt = optim.adamw(0.1, mask=lambda p: {k: k != "router_bias" for k in p})
    updates, _ = opt.update({"w": torch.ones(3), "router_bias": torch.ones(3)}, opt.init(params), params)
    assert torch.count_nonzero(updates["router_bias"]) == 0 and torch.all(updates["w"] < 0)


def test_mask_must_be_static_bools():
    params = {"w": torch.ones(3)}
    opt = optim.adamw(0.1, mask={"w": torch.tensor(True)})
    with pytest.raises(TypeError, match="Python bools"):
        opt.update(params, opt.init(params), params)


def test_wrong_state_says_how_to_fix():
    params = {"w": torch.ones(3)}
    with pytest.raises(ValueError, match="init"):
        optim.adamw(0.1).update(params, optim.EmptyState(), params)


# ----------------------------------------------------------------------------- clipping


@pytest.mark.parametrize("max_norm", [0.5, 1e3])
def test_clip_by_global_norm_matches_torch(max_norm):
    grads = _grads(0, _params())
    ours, state = optim.clip_by_global_norm(max_norm).update(grads, None)
    tensors = [g.clone() for g in _flat(grads).values()]
    holders = [torch.zeros_like(t, requires_grad=True) for t in tensors]
    for h, t in zip(holders, tensors):
        h.grad = t
    norm = torch.nn.utils.clip_grad_norm_(holders, max_norm)
    torch.testing.assert_close(state.global_norm, norm)
    _assert_close(ours, {k: h.grad for k, h in zip(_flat(grads), holders)})


def test_global_norm_hand_computed():
    assert float(optim.global_norm({"a": torch.tensor([3.0]), "b": {"c": torch.tensor([[4.0]])}})) == 5.0


def test_chain_threads_states_in_order():
    params = {"w": torch.zeros(2)}
    opt = optim.chain(optim.clip_by_global_norm(1.0), optim.adam(0.1))
    state = opt.init(params)
    assert isinstance(state[0], optim.ClipByGlobalNormState)
    updates, state = opt.update({"w": torch.tensor([30.0, 40.0])}, state, params)
    assert float(state[0].global_norm) == 50.0
    torch.testing.assert_close(updates["w"], torch.tensor([-0.1, -0.1]))


# ----------------------------------------------------------------------------- schedules


def test_warmup_cosine_hand_checked():
    lr = optim.warmup_cosine(1.0, warmup_steps=2, total_steps=6, min_ratio=0.0)
    c = math.cos(math.pi / 4)
    expected = [0.5, 1.0, 1.0, 0.5 * (1 + c), 0.5, 0.5 * (1 - c), 0.0, 0.0]
    assert [float(lr(s)) for s in range(8)] == pytest.approx(expected, abs=1e-6)


def test_warmup_cosine_min_ratio_and_no_warmup():
    lr = optim.warmup_cosine(2.0, warmup_steps=0, total_steps=4, min_ratio=0.25)
    assert [float(lr(torch.tensor(s))) for s in (0, 2, 4, 9)] == pytest.approx([2.0, 1.25, 0.5, 0.5])


def test_warmup_cosine_rejects_bad_ratio():
    with pytest.raises(ValueError, match="min_ratio"):
        optim.warmup_cosine(1.0, 1, 10, min_ratio=2.0)


# ----------------------------------------------------------------------------- traceability


def _step_fn():
    opt = optim.chain(
        optim.clip_by_global_norm(1.0), optim.adamw(optim.warmup_cosine(1e-2, 2, 10, 0.1), weight_decay=0.1)
    )

    def loss(p, x):
        return torch.tanh(x @ p["embed"]).sum() + (p["layers"]["w"] ** 2).sum() + p["bias"].sum()

    def step(p, s, x):
        value, g = value_and_grad(loss)(p, x)
        u, s = opt.update(g, s, p)
        return optim.apply_updates(p, u), s, value

    return opt, step


def test_full_step_traces_with_make_fx():
    opt, step = _step_fn()
    params, x = _params(), torch.randn(4, 7)
    state = opt.init(params)
    graph = make_fx(step)(params, state, x)
    # No host syncs: no `_local_scalar_dense` (what .item() lowers to) anywhere in the graph.
    assert "_local_scalar_dense" not in str(graph.graph)
    ours = graph(params, state, x)
    ref = step(params, state, x)
    for a, b in zip(tree_leaves(ours), tree_leaves(ref)):
        torch.testing.assert_close(a, b)


# ----------------------------------------------------------------------------- transforms


def test_value_and_grad_matches_autograd():
    params, x = _params(), torch.randn(4, 7)

    def f(p, x):
        return (torch.tanh(x @ p["embed"]) @ p["layers"]["w"][0]).square().mean()

    value, grads = value_and_grad(f)(params, x)
    leaf = params["embed"].clone().requires_grad_(True)
    ref = f({**params, "embed": leaf}, x)
    ref.backward()
    torch.testing.assert_close(value, ref.detach())
    torch.testing.assert_close(grads["embed"], leaf.grad)
    assert torch.count_nonzero(grads["bias"]) == 0


def test_value_and_grad_aux_and_argnums():
    def f(a, b):
        return (a * b).sum(), {"a2": a * a}

    (value, aux), (ga, gb) = value_and_grad(f, argnums=(0, 1), has_aux=True)(torch.tensor([2.0]), torch.tensor([3.0]))
    assert float(value) == 6.0 and float(aux["a2"]) == 4.0 and float(ga) == 3.0 and float(gb) == 2.0
    assert float(grad(lambda w: (w**2).sum())(torch.tensor(3.0))) == 6.0
    assert float(grad(lambda w: (stop_gradient(w) * w).sum())(torch.tensor(3.0))) == 3.0


def test_bad_argnums():
    with pytest.raises(TypeError, match="argnums"):
        value_and_grad(lambda x: x, argnums=())


# ----------------------------------------------------------------------------- eager and traced forms


def _clipped_masked_adamw():
    mask = {"embed": True, "layers": {"w": True, "norm": False}, "bias": True}
    return optim.chain(optim.clip_by_global_norm(0.5),
                       optim.adamw(optim.warmup_cosine(1e-2, 2, 10, 0.1), 0.9, 0.95, weight_decay=0.1, mask=mask))


def test_eager_foreach_form_matches_the_traced_form_and_writes_no_input():
    opt, params = _clipped_masked_adamw(), _params(3)
    state = opt.init(params)

    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    traced = make_fx(step)(params, state, _grads(0, params))
    assert "_foreach" not in str(traced.graph)  # traced: one op per leaf, as the partitioner shards them
    eager_p, eager_s, traced_p, traced_s = params, state, params, state
    for s in range(4):
        grads = _grads(s, params)
        before = [x.clone() for x in tree_leaves((eager_p, eager_s, grads))]
        new_p, new_s = step(eager_p, eager_s, grads)
        assert all(torch.equal(a, b) for a, b in zip(before, tree_leaves((eager_p, eager_s, grads))))
        eager_p, eager_s = new_p, new_s
        traced_p, traced_s = traced(traced_p, traced_s, grads)
    for a, b in zip(tree_leaves((eager_p, eager_s)), tree_leaves((traced_p, traced_s))):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert torch.equal(eager_p["layers"]["norm"], params["layers"]["norm"])  # masked off: untouched


def test_traced_adamw_takes_the_eager_forms_ops_leaf_by_leaf():
    """Traced (the per-rank programs of a mesh run eagerly), AdamW makes the same full-size tensors
    per leaf as its eager foreach form, in the same order, so the two agree bit for bit; and no
    more of them than that form: lerp, mul + addcmul, sqrt, div, add, div, div, add (decay), mul
    (lr), and the update's add: 11 per leaf, and one zero-filled gradient for the masked-off leaf."""
    mask = {"embed": True, "layers": {"w": True, "norm": False}, "bias": True}
    opt, params = optim.adamw(optim.warmup_cosine(1e-2, 2, 10, 0.1), 0.9, 0.95, weight_decay=0.1, mask=mask), _params(4)

    def step(params, state, grads):
        updates, state = opt.update(grads, state, params)
        return optim.apply_updates(params, updates), state

    traced = make_fx(step)(params, opt.init(params), _grads(0, params))
    full_size = [n for n in traced.graph.nodes if n.op == "call_function" and getattr(n.meta.get("val"), "ndim", 0) > 0]
    assert len(full_size) == 11 * len(tree_leaves(params)) + 1
    eager_p, eager_s, traced_p, traced_s = params, opt.init(params), params, opt.init(params)
    for s in range(3):
        grads = _grads(s, params)
        eager_p, eager_s = step(eager_p, eager_s, grads)
        traced_p, traced_s = traced(traced_p, traced_s, grads)
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves((eager_p, eager_s)), tree_leaves((traced_p, traced_s))))


def test_adamw_eager_is_the_chain_it_stands_for():
    params, lr = _params(4), optim.warmup_cosine(1e-2, 2, 10, 0.1)
    fused = optim.adamw(lr, 0.9, 0.95, weight_decay=0.1)
    chained = optim.chain(optim.scale_by_adam(0.9, 0.95), optim.add_decayed_weights(0.1),
                          optim.scale_by_learning_rate(lr))
    s1, s2 = fused.init(params), chained.init(params)
    for s in range(3):
        u1, s1 = fused.update(_grads(s, params), s1, params)
        u2, s2 = chained.update(_grads(s, params), s2, params)
        assert all(torch.equal(a, b) for a, b in zip(tree_leaves((u1, s1)), tree_leaves((u2, s2))))


def test_masked_with_every_leaf_selected_is_the_inner_transform():
    params = _params(5)
    inner = optim.adamw(1e-2, weight_decay=0.1)
    everything = optim.masked(inner, lambda p: tree_map(lambda _: True, p))
    u1, s1 = everything.update(_grads(0, params), everything.init(params), params)
    u2, s2 = inner.update(_grads(0, params), inner.init(params), params)
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves((u1, s1)), tree_leaves((u2, s2))))


def test_value_and_grad_under_make_fx_records_autograds_own_backward_kernels():
    """Traced (the partitioner's make_fx) with nothing composing, the gradient is autograd's:
    ``silu``'s backward is one ``silu_backward``, not torch.func's differentiable form of eight
    ops; inside a transform the traced gradient is still torch.func's and composes."""
    w, x = torch.randn(5, 3), torch.randn(4, 5)

    def loss(w, x):
        return torch.nn.functional.silu(x @ w).square().mean()

    def targets(fn, *args):
        return {str(n.target) for n in make_fx(fn)(*args).graph.nodes if n.op == "call_function"}

    plain = targets(lambda w, x: value_and_grad(loss)(w, x)[1], w, x)
    assert "aten.silu_backward.default" in plain and "aten.sigmoid.default" not in plain
    composed = targets(lambda w, x: torch.func.vmap(lambda xi: value_and_grad(loss)(w, xi[None])[1])(x), w, x)
    assert "aten.silu_backward.default" not in composed and "aten.sigmoid.default" in composed
    graph_grad = make_fx(lambda w, x: value_and_grad(loss)(w, x)[1])(w, x)(w, x)
    torch.testing.assert_close(graph_grad, torch.func.grad(loss)(w, x))


def test_value_and_grad_takes_plain_autograd_eagerly_and_composes_under_transforms():
    params, x = _params(), torch.randn(4, 7)
    seen = []

    def f(p, x):
        seen.append(eager())  # no transform around the function: plain autograd runs it
        return (torch.tanh(x @ p["embed"]) @ p["layers"]["w"][0]).square().mean() + p["bias"].sum() * 0

    value, grads = value_and_grad(f)(params, x)
    assert seen == [True]
    ref_value, ref_grads = torch.func.grad_and_value(f)(params, x)[::-1]
    assert value.grad_fn is None and all(g.grad_fn is None for g in tree_leaves(grads))
    torch.testing.assert_close(value, ref_value)
    for a, b in zip(tree_leaves(grads), tree_leaves(ref_grads)):
        torch.testing.assert_close(a, b)
    with torch.no_grad():  # like torch.func.grad, an outer no_grad does not stop it
        torch.testing.assert_close(value_and_grad(f)(params, x)[1]["embed"], ref_grads["embed"])
    # Composed: a per-example gradient under vmap, and a second derivative through it.
    per_example = torch.func.vmap(lambda xi: value_and_grad(lambda w: (xi @ w).square().sum())(params["embed"])[1])(x)
    torch.testing.assert_close(per_example[0], 2 * torch.outer(x[0], x[0] @ params["embed"]))
    hess_diag = torch.func.grad(lambda w: value_and_grad(lambda w: (w ** 3).sum())(w)[1].sum())(torch.ones(3))
    torch.testing.assert_close(hess_diag, torch.full((3,), 6.0))
    # An argument that already requires grad keeps its outer graph (the torch.func path).
    w = params["bias"].clone().requires_grad_(True)
    (g,) = torch.autograd.grad(value_and_grad(lambda w: (w ** 3).sum())(w)[1].sum(), [w])
    torch.testing.assert_close(g, 6 * w.detach())


def _moe_like_tree(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(4, 8, generator=g), "experts": torch.randn(3, 8, 4, generator=g),
            "router_bias": torch.randn(3, generator=g), "norm": torch.randn(8, generator=g)}


def test_fused_adamw_is_the_update_applied_and_leaves_masked_leaves_alone():
    # update_and_apply: eagerly, the clipped, masked AdamW chain computes the new parameters as
    # torch.optim.AdamW(foreach=True) writes them (decay, then one addcdiv): the update then
    # apply_updates to float rounding, the same state to the bit, every frozen leaf untouched
    from shardfn.core.optim import update_and_apply

    params = _moe_like_tree()
    mask = {"w": True, "experts": True, "router_bias": False, "norm": True}
    opt = optim.chain(optim.clip_by_global_norm(1.0),
                      optim.adamw(optim.warmup_cosine(1e-2, 2, 10), b2=0.95, weight_decay=0.1, mask=mask))
    state = opt.init(params)
    frozen = params["router_bias"]
    for step in range(5):
        grads = _moe_like_tree(step + 1)
        updates, ref_state = opt.update(grads, state, params)
        ref_params = optim.apply_updates(params, updates)
        params, state = update_and_apply(opt, grads, state, params)
        assert params["router_bias"] is frozen
        for k in params:
            torch.testing.assert_close(params[k], ref_params[k], rtol=1e-6, atol=1e-7)
        assert all(torch.equal(a, b) for a, b in zip(tree_leaves(state), tree_leaves(ref_state)))


def test_fused_adamw_falls_back_to_update_then_apply_where_it_does_not_apply():
    from torch.fx.experimental.proxy_tensor import make_fx

    from shardfn.core.optim import update_and_apply

    params, grads = _moe_like_tree(), _moe_like_tree(1)
    opt = optim.adamw(1e-2, weight_decay=0.1)
    state = opt.init(params)

    def traced(g, s, p):
        return update_and_apply(opt, g, s, p)

    gm = make_fx(traced)(grads, state, params)
    assert not any("_foreach" in str(n.target) for n in gm.graph.nodes)  # one op per leaf, as the update's
    new, _ = gm(grads, state, params)
    updates, _ = opt.update(grads, state, params)
    want = optim.apply_updates(params, updates)
    assert all(torch.equal(new[k], want[k]) for k in want)


def test_donated_update_writes_in_place_with_the_same_bits():
    # donate=True: the fused AdamW writes the new parameters and moments into the tensors it was
    # given (torch.optim's in-place kernels); the values are the undonated call's, bit for bit
    from shardfn.core.optim import update_and_apply

    mask = {"w": True, "experts": True, "router_bias": False, "norm": True}
    opt = optim.chain(optim.clip_by_global_norm(1.0),
                      optim.adamw(optim.warmup_cosine(1e-2, 2, 10), b2=0.95, weight_decay=0.1, mask=mask))
    kept = _moe_like_tree()
    given = tree_map(torch.clone, kept)
    kept_state, given_state = opt.init(kept), opt.init(given)
    memory = [x.data_ptr() for x in tree_leaves((given, given_state[1][0].mu, given_state[1][0].nu))]
    for step in range(4):
        grads = _moe_like_tree(step + 1)
        kept, kept_state = update_and_apply(opt, grads, kept_state, kept)
        given, given_state = update_and_apply(opt, grads, given_state, given, donate=True)
    assert [x.data_ptr() for x in tree_leaves((given, given_state[1][0].mu, given_state[1][0].nu))] == memory
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves((kept, kept_state)), tree_leaves((given, given_state))))
