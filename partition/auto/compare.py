"""Two auto-sharding plans side by side, term by term: where one spends what the other does not.

Both plans price the same traced graph with their own cost models; the rows name each node whose
placement or cost differs, with compute, communication, resharding and bytes per rank of each.

    a = solve(traced, mesh); b = solve(traced, mesh, fixed_specs=presets(...)["fsdp"])
    print(compare_table(a, b))
"""

from __future__ import annotations

TERMS = ("compute_s", "comm_s", "reshard_s", "bytes")


def compare(a, b) -> list[dict]:
    """Rows ``{"node", "a", "b", compute_s, comm_s, reshard_s, bytes}`` where each term is a pair
    ``(a's, b's)`` and ``"a"``/``"b"`` describe the node's output placements in each plan. The
    first row, ``node="total"``, has the estimated step's terms (``bytes``: the peak per rank);
    then every node where the plans differ, the largest time difference first.

        rows = compare(result_a, result_b); rows[0]["comm_s"]   # (a's comm seconds, b's)
    """
    if [n.name for n in a._problem.nodes] != [n.name for n in b._problem.nodes]:
        raise ValueError("compare(a, b): the plans were solved for different graphs; solve both for one traced step")
    total = {"node": "total", "a": "", "b": ""}
    for term, field in zip(TERMS, ("compute_s", "comm_s", "reshard_s", "memory_bytes")):
        total[term] = (getattr(a.cost, field), getattr(b.cost, field))
    ca, cb = a.node_costs(), b.node_costs()
    pa, pb = a.placements, b.placements
    rows = []
    for name in list(dict.fromkeys([*ca, *cb])):
        ra, rb = ca.get(name, _ZERO), cb.get(name, _ZERO)
        same_terms = all(abs(ra[t] - rb[t]) <= 1e-12 * max(1.0, abs(ra[t])) for t in TERMS)
        if same_terms and pa.get(name) == pb.get(name):
            continue
        row = {"node": name, "a": _placed(a, pa.get(name)), "b": _placed(b, pb.get(name))}
        row.update({t: (ra[t], rb[t]) for t in TERMS})
        rows.append(row)
    rows.sort(key=lambda r: -abs(sum(r[t][0] - r[t][1] for t in TERMS[:3])))
    return [total, *rows]


def compare_table(a, b, *, limit: int = 20) -> str:
    """:func:`compare` as a text table (the ``limit`` largest differences).

        print(compare_table(auto_plan, fsdp_plan))
    """
    from shardfn.core.units import format_bytes
    from shardfn.partition.auto.result import _fmt_s

    rows = compare(a, b)
    head = (f"{'node':<28} {'compute a/b':>21} {'comm a/b':>21} {'reshard a/b':>21} {'bytes a/b':>23}  "
            f"placements a | b")
    lines = [head, "-" * len(head)]
    for r in rows[: limit + 1]:
        cells = [f"{_fmt_s(r[t][0])}/{_fmt_s(r[t][1])}" for t in TERMS[:3]]
        mem = f"{format_bytes(r['bytes'][0])}/{format_bytes(r['bytes'][1])}"
        lines.append(f"{r['node'][:28]:<28} {cells[0]:>21} {cells[1]:>21} {cells[2]:>21} {mem:>23}  "
                     f"{r['a']} | {r['b']}")
    if len(rows) > limit + 1:
        lines.append(f"... {len(rows) - limit - 1} more nodes differ")
    return "\n".join(lines)


_ZERO = {"compute_s": 0.0, "comm_s": 0.0, "reshard_s": 0.0, "bytes": 0}


def _placed(result, placements) -> str:
    return "-" if placements is None else result.describe(placements)
