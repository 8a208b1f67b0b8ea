"""Mixture-of-experts pieces: a token-choice top-k router, dropless dispatch and grouped-GEMM experts.

The layer is three separable steps, so expert parallelism can replace one without touching the
others (a per-rank region around :func:`expert_compute`, all-to-alls in place of
:func:`dispatch`/:func:`combine`):

    routing = route(x, p["router"], p["router_bias"], cfg)       # which experts, what weights
    x_sorted, d = dispatch(x, routing.indices, n_experts)        # permute tokens expert-major
    y_sorted = expert_compute(x_sorted, d.counts, w1, w2, w3)    # one grouped GEMM per projection
    y = combine(y_sorted, d, routing.weights)                    # weighted scatter-add back

:func:`moe_layer` chains them, adds the shared experts and returns ``(y, aux)``.

Routing follows DeepSeek-V3: scores are ``softmax`` or ``sigmoid`` of the router logits; an
optional node limit keeps each token within ``topk_groups`` of ``n_groups`` expert groups, a
group scoring the sum of its top-2 expert scores; a learned-by-rule bias (auxiliary-loss-free
balancing, :func:`update_expert_bias`) is added for *selection only*, so the combine weights
come from the unbiased scores and the bias gets no gradient. Every shape is static (no
``bincount``, no boolean masks), so the layer traces with fake tensors.

The router's ``cfg`` is any object with the attributes ``n_experts``, ``top_k``, ``score_func``,
``n_groups``, ``topk_groups``, ``route_scale``, ``norm_topk_prob`` and ``aux_loss_alpha`` (the
MoE model's Config has them all).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from shardfn.core.expert_ffn import SWIGLU, ExpertFFN
from shardfn.core.layers import swiglu
from shardfn.core.scope import scope

__all__ = [
    "Routing", "Dispatch", "router_scores", "route", "expert_counts", "tokens_per_expert", "dispatch", "expert_compute",
    "combine", "routed_experts", "sequence_balance_loss", "update_expert_bias", "moe_layer",
]

SCORE_FUNCS = ("softmax", "sigmoid")


class Routing(NamedTuple):
    """The router's decision for ``T`` tokens."""

    indices: torch.Tensor  # [T, k] int64 selected experts
    weights: torch.Tensor  # [T, k] combine weights (from unbiased scores), x's dtype
    scores: torch.Tensor   # [T, E] float32 unbiased scores (softmax or sigmoid)


class Dispatch(NamedTuple):
    """How the ``T * k`` token-expert assignments were permuted to expert-major order."""

    order: torch.Tensor    # [T*k] int64: flat assignment index (t * k + j) of each sorted row
    token: torch.Tensor    # [T*k] int64: source token of each sorted row
    counts: torch.Tensor   # [E] int64: rows per expert


# ----------------------------------------------------------------------------- router


def router_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    """Expert scores in float32: ``softmax`` over experts, or an independent ``sigmoid`` each.

    Example:
        router_scores(torch.randn(4, 8), "sigmoid").shape  # torch.Size([4, 8])
    """
    if score_func == "softmax":
        return logits.float().softmax(dim=-1)
    if score_func == "sigmoid":
        return logits.float().sigmoid()
    raise ValueError(f"unknown score_func {score_func!r}; valid: {', '.join(SCORE_FUNCS)}")


def _limit_to_groups(select: torch.Tensor, n_groups: int, topk_groups: int) -> torch.Tensor:
    """``select`` with every expert outside each token's ``topk_groups`` best groups set to -inf."""
    t, e = select.shape
    grouped = select.view(t, n_groups, e // n_groups)                         # [T, G, E/G]
    group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)                  # [T, G]
    keep = group_scores.topk(topk_groups, dim=-1).indices                      # [T, topk_groups]
    kept = torch.zeros_like(group_scores).scatter(1, keep, 1.0).bool()          # [T, G]
    return grouped.masked_fill(~kept.unsqueeze(-1), float("-inf")).view(t, e)


def route(x: torch.Tensor, w_router: torch.Tensor, bias: torch.Tensor | None, cfg) -> Routing:
    """Top-k token-choice routing (DeepSeek-V3 rules, see the module docstring).

    Args:
        x: ``[T, D]`` tokens.
        w_router: ``[D, E]``.
        bias: ``[E]`` selection bias, or None. Shifts which experts are picked, never the weights.
        cfg: routing hyperparameters (``top_k``, ``score_func``, ``n_groups``, ``topk_groups``,
            ``route_scale``, ``norm_topk_prob``).

    Returns:
        :class:`Routing`. Weights are the unbiased scores of the picked experts, divided by their
        sum when ``norm_topk_prob``, times ``route_scale``.

    Example:
        r = route(torch.randn(16, 64), torch.randn(64, 8), torch.zeros(8), cfg)
        r.indices.shape, r.weights.shape  # (torch.Size([16, 2]), torch.Size([16, 2]))
    """
    with scope("shardfn.moe.route"):
        scores = router_scores(x @ w_router, cfg.score_func)                  # [T, E]
        select = scores if bias is None else scores + bias.float()
        if cfg.n_groups > 1:
            select = _limit_to_groups(select, cfg.n_groups, cfg.topk_groups)
        indices = select.topk(cfg.top_k, dim=-1).indices                       # [T, k]
        weights = scores.gather(1, indices)                                    # [T, k]
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * cfg.route_scale
        return Routing(indices, weights.to(x.dtype), scores)


def expert_counts(indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Assignments per expert, ``[E]`` int64 (a static-shape ``bincount``).

    Example:
        expert_counts(torch.tensor([[0, 2], [2, 3]]), 4)  # tensor([1, 0, 2, 1])
    """
    flat = indices.reshape(-1)
    return torch.zeros(n_experts, dtype=torch.int64, device=flat.device).index_add(0, flat, torch.ones_like(flat))


def tokens_per_expert(indices: torch.Tensor, n_experts: int) -> torch.Tensor:
    """:func:`expert_counts` as a sum over tokens of a one-hot ``[T*k, E]`` mask: with the tokens
    split over ranks each rank sums its own and the total is one all-reduce of ``[E]`` (an
    ``index_add`` into a replicated count would all-gather every token's indices first).

    Example:
        tokens_per_expert(torch.tensor([[0, 2], [2, 3]]), 4)  # tensor([1, 0, 2, 1])
    """
    flat = indices.reshape(-1, 1)
    return (flat == torch.arange(n_experts, device=flat.device)).sum(0)


# ----------------------------------------------------------------------------- dispatch and experts


def dispatch(x: torch.Tensor, indices: torch.Tensor, n_experts: int) -> tuple[torch.Tensor, Dispatch]:
    """Copy each token once per selected expert and sort the copies by expert (stable).

    Args:
        x: ``[T, D]``.
        indices: ``[T, k]`` from :func:`route`.
        n_experts: ``E``.

    Returns:
        ``(x_sorted [T*k, D], Dispatch)``; rows of expert ``e`` are contiguous, in token order.

    Example:
        x_sorted, d = dispatch(x, routing.indices, 8)
    """
    with scope("shardfn.moe.dispatch"):
        k = indices.shape[1]
        flat = indices.reshape(-1)                                             # [T*k]
        order = torch.argsort(flat, stable=True)                               # [T*k]
        token = order // k
        return x[token], Dispatch(order, token, expert_counts(indices, n_experts))


def expert_compute(x_sorted: torch.Tensor, counts: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
                   w3: torch.Tensor) -> torch.Tensor:
    """Every expert's SwiGLU on its contiguous rows, as three grouped GEMMs.

    Args:
        x_sorted: ``[R, D]`` rows grouped by expert (``counts[e]`` rows for expert ``e``).
        counts: ``[E]`` integer rows per expert (zero is fine); ``counts.sum() == R``.
        w1, w3: ``[E, D, F]``.
        w2: ``[E, F, D]``.

    Returns:
        ``[R, D]``.

    Example:
        y = expert_compute(torch.randn(6, 16), torch.tensor([4, 0, 2]), w1, w2, w3)  # [6, 16]
    """
    return _ffn_compute(SWIGLU, x_sorted, counts, (w1, w2, w3))


def _ffn_compute(ffn: ExpertFFN, x_sorted: torch.Tensor, counts: torch.Tensor, weights: tuple) -> torch.Tensor:
    with scope("shardfn.moe.experts"):
        offs = torch.cumsum(counts, 0).to(torch.int32)                         # [E] group ends
        return ffn(x_sorted, offs, *weights)                                   # [R, D]


def combine(y_sorted: torch.Tensor, d: Dispatch, weights: torch.Tensor) -> torch.Tensor:
    """Weight each expert output by its routing weight and sum them back onto their tokens.

    Args:
        y_sorted: ``[T*k, D]`` expert outputs in :func:`dispatch` order.
        d: the :class:`Dispatch` of that order.
        weights: ``[T, k]`` from :func:`route`.

    Returns:
        ``[T, D]``.

    Example:
        y = combine(expert_compute(x_sorted, d.counts, w1, w2, w3), d, routing.weights)
    """
    with scope("shardfn.moe.combine"):
        t = weights.shape[0]
        w_sorted = weights.reshape(-1)[d.order].unsqueeze(-1)                  # [T*k, 1]
        out = y_sorted.new_zeros((t, y_sorted.shape[1]))
        return out.index_add(0, d.token, y_sorted * w_sorted)                  # [T, D]


def routed_experts(x: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor, *expert_weights: torch.Tensor,
                   ffn: ExpertFFN = SWIGLU) -> torch.Tensor:
    """The routed part of the layer on one device: dispatch, experts, combine (dropless).

    This is the seam for expert parallelism: a function with this signature
    (``runtime.moe_dispatch.ExpertRegion``) can replace it in :func:`moe_layer` (its ``routed_fn``)
    and in any model whose loss takes ``experts=``.

    Args:
        x: ``[T, D]``; indices, weights: ``[T, k]``.
        expert_weights: the experts' stacked weights as ``ffn`` takes them (``SwiGLU``:
            ``w1, w3 [E, D, F]``, ``w2 [E, F, D]``).
        ffn: the experts' feed-forward (``core.expert_ffn``).

    Returns:
        ``[T, D]``.

    Example:
        y = routed_experts(x, r.indices, r.weights, p["experts"]["w1"], p["experts"]["w2"], p["experts"]["w3"])
    """
    x_sorted, d = dispatch(x, indices, expert_weights[0].shape[0])
    return combine(_ffn_compute(ffn, x_sorted, d.counts, expert_weights), d, weights)


# ----------------------------------------------------------------------------- balance


def sequence_balance_loss(scores: torch.Tensor, indices: torch.Tensor, batch_size: int) -> torch.Tensor:
    """DeepSeek-V3's complementary sequence-wise balance loss (without the ``alpha`` factor).

    Per sequence of ``S`` tokens: ``sum_i f_i * P_i`` with ``f_i = E / (k S) * #{t: i in topk(t)}``
    and ``P_i = mean_t s'_{t,i}``, ``s'`` the scores normalised to sum 1 over experts; averaged over
    sequences. It is 1 when routing is uniform. Gradients flow through ``P`` only.

    Args:
        scores: ``[B*S, E]`` unbiased router scores.
        indices: ``[B*S, k]`` selected experts.
        batch_size: ``B``.

    Returns:
        A 0-d float32 tensor.

    Example:
        sequence_balance_loss(r.scores, r.indices, batch_size=2)
    """
    n_tok, n_experts = scores.shape
    k = indices.shape[1]
    seq = n_tok // batch_size
    s = scores.view(batch_size, seq, n_experts)
    p = (s / s.sum(-1, keepdim=True)).mean(1)                                  # [B, E]
    picks = indices.view(batch_size, seq * k)
    hits = torch.zeros_like(p).scatter_add(1, picks, torch.ones_like(picks, dtype=p.dtype))  # [B, E]
    f = hits * (n_experts / (k * seq))
    return (f * p).sum(-1).mean()


def update_expert_bias(bias: torch.Tensor, counts: torch.Tensor, rate: float) -> torch.Tensor:
    """Auxiliary-loss-free balancing (DeepSeek-V3): ``bias + rate * sign(mean(counts) - counts)``.

    Overloaded experts get a lower selection bias, underloaded ones a higher one. Works on one
    layer (``[E]``) or a stack (``[L, E]``; the mean is per layer).

    Example:
        update_expert_bias(torch.zeros(4), torch.tensor([5, 1, 1, 1]), 1e-3)  # [-1e-3, 1e-3, 1e-3, 1e-3]
    """
    counts = counts.to(bias.dtype)
    return bias + rate * torch.sign(counts.mean(-1, keepdim=True) - counts)


# ----------------------------------------------------------------------------- the layer


def moe_layer(p: dict, x: torch.Tensor, cfg, *, routed_fn: Callable | None = None) -> tuple[torch.Tensor, dict]:
    """A DeepSeek-V3 MoE feed-forward: routed experts (dropless) plus shared experts.

    Args:
        p: ``router [D, E]``, ``router_bias [E]``, ``experts: {w1 [E, D, F], w3 [E, D, F],
            w2 [E, F, D]}`` and optionally ``shared: {w1 [D, n_shared*F], w3, w2}``.
        x: ``[B, S, D]``.
        cfg: see the module docstring.
        routed_fn: ``(x, indices, weights, w1, w2, w3) -> y`` for the routed experts (None: this
            device, :func:`routed_experts`); a layout passes its per-rank region here (expert
            parallelism: the all-to-all exchange in the runtime), and model code never changes.
            A ``routed_fn`` whose ``takes_shared`` is true also takes the shared experts'
            ``w1, w2, w3`` last and adds their output (a layout that runs them while its
            exchange is in flight); otherwise they run here, after the routed ones.

    Returns:
        ``(y [B, S, D], aux)`` with ``aux["expert_counts"]`` ``[E]`` int64 (assignments per expert)
        and ``aux["balance_loss"]`` (0-d, already times ``cfg.aux_loss_alpha``; zero when 0).

    Example:
        y, aux = moe_layer(p, torch.randn(2, 16, 64), cfg)
    """
    b, s, dim = x.shape
    with scope("shardfn.moe"):
        flat = x.reshape(b * s, dim)                                           # [T, D]
        r = route(flat, p["router"], p.get("router_bias"), cfg)
        e = p["experts"]
        routed_fn = routed_fn or routed_experts
        sh = p.get("shared")
        if sh is not None and getattr(routed_fn, "takes_shared", False):  # the layout runs them behind its exchange
            y = routed_fn(flat, r.indices, r.weights, e["w1"], e["w2"], e["w3"], sh["w1"], sh["w2"], sh["w3"])
        else:
            y = routed_fn(flat, r.indices, r.weights, e["w1"], e["w2"], e["w3"])  # [T, D]
            if sh is not None:
                y = y + swiglu(sh, flat)
        if cfg.aux_loss_alpha > 0:
            balance = cfg.aux_loss_alpha * sequence_balance_loss(r.scores, r.indices, b)
        else:
            balance = torch.zeros((), device=x.device)
        aux = {"expert_counts": tokens_per_expert(r.indices, cfg.n_experts), "balance_loss": balance}
        return y.view(b, s, dim), aux
