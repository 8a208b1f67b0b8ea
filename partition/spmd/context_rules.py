"""Context parallelism: the sequence dim of activations split over the ``cp`` mesh axis.

Three pieces, and no model code (see docs/context.md):

- **Load balance.** Causal attention gives late tokens more keys than early ones, so contiguous
  chunks would leave rank 0 idle. The sequence is cut into ``2 * cp`` chunks and rank ``i``
  holds chunks ``i`` and ``2 * cp - 1 - i`` (:func:`load_balance_order`): every rank does the
  same work. The permutation is applied to the batch (:func:`balanced_batch`: ``inputs``,
  ``targets`` and a new ``positions`` ``[B, S]``), so the loss, a mean over tokens, is the
  one-device loss; RoPE reads each token's true position (``core.layers.rope_at``) and the
  attention mask compares true positions (``core.positional_attention``).
- **Attention over a split sequence.** :func:`register_rules` gives the partitioner sharding
  rules for ``shardfn::positional_attention`` and its backward: queries (and their positions)
  stay split over the sequence, keys, values and key positions are gathered (an all-gather of
  K/V per layer), and the backward's key/value gradients come out as partial sums that the
  partitioner reduce-scatters back onto the split sequence. Everything else in the model is
  per token and needs no rule of ours.
- **Layout facts** (the ``cp`` axis, the ``seq`` rule, divisibility) live in
  ``partition.layouts.axes``.

    batch = balanced_batch(batch, cp=2)       # tokens in load-balanced order, with positions
    register_rules()                          # once (partition.spmd.op_rules.register_all calls it)
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

__all__ = ["load_balance_order", "balanced_batch", "register_rules", "exchange_bytes_per_layer"]


def load_balance_order(seq_len: int, cp: int) -> torch.Tensor:
    """The positions in the order the split sequence holds them: ``2 * cp`` chunks, rank ``i``
    holding chunks ``i`` and ``2 * cp - 1 - i``, one after the other.

    Raises:
        ValueError: ``seq_len`` is not a multiple of ``2 * cp`` (naming ``train.seq_len``).

    Example:
        load_balance_order(8, 2)   # tensor([0, 1, 6, 7, 2, 3, 4, 5])
    """
    if seq_len % (2 * cp):
        raise ValueError(f"train.seq_len: {seq_len} is not divisible by 2 * mesh.cp = {2 * cp} (each rank holds "
                         f"two equal chunks of the sequence); use a multiple of {2 * cp}")
    chunks = torch.arange(seq_len).view(2 * cp, seq_len // (2 * cp))
    return torch.cat([torch.cat([chunks[i], chunks[2 * cp - 1 - i]]) for i in range(cp)])


def balanced_batch(batch: dict, cp: int) -> dict:
    """``batch`` with ``inputs`` and ``targets`` (``[B, S]``) in :func:`load_balance_order` and
    ``positions`` ``[B, S]`` (each token's true position) added. With ``cp == 1`` (or a batch
    that already has ``positions``) it is returned unchanged.

    Example:
        balanced_batch({"inputs": x, "targets": y}, cp=2)["positions"][0]   # [0, 1, 6, 7, 2, 3, 4, 5] for S = 8
    """
    if cp == 1 or "positions" in batch:
        return batch
    rows, seq_len = batch["inputs"].shape
    order = load_balance_order(seq_len, cp).to(batch["inputs"].device)
    out = {k: v[:, order] if k in ("inputs", "targets") else v for k, v in batch.items()}
    out["positions"] = order.expand(rows, seq_len).contiguous()
    return out


def exchange_bytes_per_layer(rows: int, seq_len: int, kv_width: int, *, value_width: int | None = None,
                             itemsize: int = 4) -> dict[str, int]:
    """The all-gather form's exchange per attention layer, in ``comm_report``'s bytes (an
    all-gather counts its gathered output, a reduce-scatter its full input). Forward: an
    all-gather each of K, V and the key positions (int64); backward: the same three again (the
    backward recomputes the attention rather than keep gathered K/V) and a reduce-scatter each
    of dK and dV. ``rows``: this data rank's batch rows; ``kv_width`` / ``value_width``: the
    elements per token of K / V as the attention op sees them (kv heads x head dim). The same
    for any ``cp``: each rank receives ``(cp - 1) / cp`` of it.

    Example:
        exchange_bytes_per_layer(8, 32, 2 * 16)   # {'all_gather': 135168, 'reduce_scatter': 65536}
    """
    value_width = kv_width if value_width is None else value_width
    kv = rows * seq_len * (kv_width + value_width) * itemsize
    return {"all_gather": 2 * (kv + rows * seq_len * 8), "reduce_scatter": kv}


_registered = False


def register_rules() -> dict:
    """Sharding rules for ``shardfn::positional_attention`` and its backward (idempotent).
    Returns ``{op: {output index: input index}}``: the backward's dK and dV partial sums are
    reduced onto K's and V's placements at once (what ``partition.spmd.op_rules.register_all`` returns).

    Per mesh dim: all replicated; split over the batch (dim 0); split over heads (dim 1, the
    positions replicated); split over the sequence (queries and their positions split, keys,
    values and key positions replicated, i.e. gathered; the backward's dK, dV partial sums).
    """
    import shardfn.core.positional_attention  # noqa: F401  (registers the ops)

    global _registered
    reduce_like_input = {torch.ops.shardfn.positional_attention_backward.default: {1: 2, 2: 3}}  # dK, dV: K, V
    if _registered:
        return reduce_like_input
    _registered = True
    from torch.distributed.tensor.experimental import register_sharding

    ops = torch.ops.shardfn
    R = Replicate()

    @register_sharding(ops.positional_attention.default)
    def _forward(q, k, v, q_pos, k_pos, scale):
        return [
            ([R], [R, R, R, R, R, None]),
            ([Shard(0)], [Shard(0)] * 5 + [None]),
            ([Shard(1)], [Shard(1)] * 3 + [R, R, None]),
            ([Shard(2)], [Shard(2), R, R, Shard(1), R, None]),
        ]

    @register_sharding(ops.positional_attention_backward.default)
    def _backward(grad, q, k, v, q_pos, k_pos, scale):
        return [
            ([R] * 3, [R] * 6 + [None]),
            ([Shard(0)] * 3, [Shard(0)] * 6 + [None]),
            ([Shard(1)] * 3, [Shard(1)] * 4 + [R, R, None]),
            ([Shard(2), Partial(), Partial()], [Shard(2), Shard(2), R, R, Shard(1), R, None]),
        ]

    return reduce_like_input
