"""The package's imports point down and never in a circle.

Layers, low to high: ``core`` -> ``models`` -> ``partition`` -> ``runtime`` -> the applications
(``config``, ``plan``, ``cli``). Every ``import`` and ``from ... import`` in the package is read
from the source (function-level imports too), so a lazy import cannot hide an upward edge.
"""

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = {"core": 0, "models": 1, "partition": 2, "runtime": 3}
# Inside ``partition``, by stage, low to high (docs/architecture.md): specs and errors, the mesh
# and the markers a traced function holds, the SPMD compiler, the graph passes and the cost
# model, the pipeline, layouts (which ask the pipeline for stages per rank), the auto-sharder,
# and ``sf.jit`` on top. Two names on one floor may import each other's modules.
PARTITION_FLOORS = {"errors": 0, "spec": 0, "mesh": 1, "constrain": 1, "local_map": 2, "spmd": 3,
                    "passes": 4, "cost": 4, "pipeline": 5, "layouts": 6, "auto": 7, "api": 8}
APPLICATION = 4
NOT_PACKAGE = {"tests", "benchmarks", "examples", "docs", "build"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(["shardfn", *parts])


def package_modules() -> dict[str, Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT).parts
        if rel[0] in NOT_PACKAGE or any(p.startswith(".") for p in rel):
            continue
        out[module_name(path)] = path
    return out


def layer(module: str) -> int | None:
    parts = module.split(".")
    if len(parts) < 2:
        return None  # the package facade re-exports from below; it is nobody's dependency
    return LAYERS.get(parts[1], APPLICATION)


def partition_part(module: str) -> str | None:
    """The sub-package or top-level module of ``partition`` that ``module`` is in, if any."""
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "partition" else None


def import_edges(modules: dict[str, Path]) -> dict[str, set[str]]:
    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    edges: dict[str, set[str]] = defaultdict(set)
    for mod, path in modules.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets = [base] + [f"{base}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                target = resolve(t) if t.startswith("shardfn") else None
                if target and target not in (mod, "shardfn"):
                    edges[mod].add(target)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (iterative Tarjan)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in list(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = counter[0]
                counter[0] += 1
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(edges.get(w, ())))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def test_imports_only_point_down():
    edges = import_edges(package_modules())
    upward = sorted(f"{a} -> {b}" for a, targets in edges.items() for b in targets
                    if layer(a) is not None and layer(b) is not None and layer(b) > layer(a))
    assert not upward, "imports from a lower layer into a higher one:\n" + "\n".join(upward)


def test_partition_imports_only_point_down_its_stages():
    modules = package_modules()
    unplaced = sorted({partition_part(m) for m in modules} - {None} - set(PARTITION_FLOORS))
    assert not unplaced, f"partition modules on no floor: {unplaced}; give each a floor in PARTITION_FLOORS"
    upward = sorted(f"{a} -> {b}" for a, targets in import_edges(modules).items() for b in targets
                    if partition_part(a) and partition_part(b)
                    and PARTITION_FLOORS[partition_part(b)] > PARTITION_FLOORS[partition_part(a)])
    assert not upward, "partition imports from a lower stage into a higher one:\n" + "\n".join(upward)


def test_no_two_modules_import_each_other():
    found = cycles(import_edges(package_modules()))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_walk_sees_function_level_and_relative_imports(tmp_path):
    """The checker itself: a lazy upward import and a two-module cycle are both caught."""
    sources = {
        "shardfn.core.a": "def f():\n    from shardfn.runtime import b\n",
        "shardfn.runtime.b": "from . import c\n",
        "shardfn.runtime.c": "import shardfn.runtime.b\n",
    }
    modules = {}
    for name, text in sources.items():
        modules[name] = tmp_path / f"{name.rpartition('.')[2]}.py"
        modules[name].write_text(text)
    edges = import_edges(modules)
    assert edges["shardfn.core.a"] == {"shardfn.runtime.b"} and layer("shardfn.core.a") < layer("shardfn.runtime.b")
    assert cycles(edges) == [["shardfn.runtime.b", "shardfn.runtime.c"]]
