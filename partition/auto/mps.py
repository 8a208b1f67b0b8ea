"""Writing a mixed-integer linear program in (free) MPS, the format every MIP solver reads.

scipy's HiGHS binding cannot write the model it solves, so the auto-sharder writes its own:
rows ``R*`` (equalities), ``M*`` (at most), the objective ``COST``; columns ``X*`` (0/1 strategy
choices, between ``INTORG``/``INTEND`` markers) and ``Y*`` (continuous, >= 0).

    write_mps("plan.mps", c, a_eq, b_eq, a_ub, b_ub, upper, integer)
    # highs plan.mps  /  cbc plan.mps  /  gurobi_cl plan.mps
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np


def write_mps(path, c, a_eq, b_eq, a_ub, b_ub, upper, integer, *, name: str = "SHARDFN") -> Path:
    """Write ``min c x  s.t.  a_eq x = b_eq, a_ub x <= b_ub, 0 <= x <= upper`` (``integer[j]``:
    ``x[j]`` is integral) to ``path``; ``a_eq``/``a_ub`` are scipy sparse matrices (``a_ub`` may be
    None). Returns the path.

        write_mps("p.mps", np.ones(2), csr_matrix([[1, 1]]), [1], None, None, [1, 1], [1, 1])
    """
    from scipy.sparse import csc_matrix, vstack

    c = np.asarray(c, dtype=float)
    n = len(c)
    blocks = [a_eq] + ([a_ub] if a_ub is not None and a_ub.shape[0] else [])
    a = csc_matrix(vstack(blocks)) if blocks else csc_matrix((0, n))
    n_eq = a_eq.shape[0]
    rows = [f"R{i}" for i in range(n_eq)] + [f"M{i}" for i in range(a.shape[0] - n_eq)]
    rhs = list(np.asarray(b_eq, dtype=float)) + ([] if len(rows) == n_eq else list(np.asarray(b_ub, dtype=float)))
    integer = np.asarray(integer, dtype=bool)
    upper = np.asarray(upper, dtype=float)
    cols = [("X" if integer[j] else "Y") + str(j) for j in range(n)]
    out = [f"NAME {name}", "ROWS", " N COST"]
    out += [f" {'E' if i < n_eq else 'L'} {r}" for i, r in enumerate(rows)]
    out.append("COLUMNS")
    in_int = False
    for j in range(n):
        if integer[j] != in_int:
            out.append(f" MARKER 'MARKER' '{'INTORG' if integer[j] else 'INTEND'}'")
            in_int = bool(integer[j])
        entries = [("COST", c[j])] if c[j] != 0 else []
        lo, hi = a.indptr[j], a.indptr[j + 1]
        entries += [(rows[r], v) for r, v in zip(a.indices[lo:hi], a.data[lo:hi]) if v != 0]
        if not entries:
            entries = [("COST", 0.0)]  # every column is named once, even without coefficients
        out += [f" {cols[j]} {r} {_num(v)}" for r, v in entries]
    if in_int:
        out.append(" MARKER 'MARKER' 'INTEND'")
    out.append("RHS")
    out += [f" RHS {r} {_num(v)}" for r, v in zip(rows, rhs) if v != 0]
    out.append("BOUNDS")
    for j in range(n):
        if upper[j] == 0:
            out.append(f" FX BND {cols[j]} 0")
        elif math.isfinite(upper[j]):
            out.append(f" UP BND {cols[j]} {_num(upper[j])}")
    out.append("ENDATA")
    path = Path(path)
    path.write_text("\n".join(out) + "\n")
    return path


def _num(v: float) -> str:
    return repr(float(v))
