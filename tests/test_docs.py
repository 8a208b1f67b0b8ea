"""The README and docs/ point at things that exist, and say nothing about how the code used to be."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md"]

# Markdown links [text](target), and paths named in text or code: docs/x.md, examples/..., ...
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
DIRS = "docs|examples|benchmarks|tests|core|models|partition|runtime|plan|cli"
NAMED = re.compile(rf"(?<![\w/.-])((?:{DIRS})/[\w./-]*\w)")

# Paths another line of work adds (the model contract: docs/models.md, examples/models/); linked
# from here already and checked like any other path once they exist.
WRITTEN_ELSEWHERE = {ROOT / "docs" / "models.md", ROOT / "examples" / "models"}


def _targets(page: Path):
    text = page.read_text()
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor in the page itself
        yield target, (page.parent / target.split("#")[0]).resolve()
    for named in NAMED.findall(text):
        if "*" in named or named.startswith("benchmarks/results"):
            continue  # a pattern, or the benchmarks' uncommitted output
        yield named, (ROOT / named).resolve()


def _exists(path: Path) -> bool:
    """The path, or ``module.attr`` read as ``module.py`` (``runtime/moe_dispatch._vjp``)."""
    if path.exists() or path in WRITTEN_ELSEWHERE:
        return True
    module, dot, _ = path.name.rpartition(".")
    return bool(dot) and path.with_name(module + ".py").exists()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_and_named_path_exists(page):
    missing = sorted({name for name, path in _targets(page) if not _exists(path)})
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"


def test_every_docs_page_is_in_the_index():
    index = (ROOT / "docs" / "README.md").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert not {p for p in pages if f"]({p})" not in index}


def test_readme_is_a_front_door():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 200
    assert "pip install -e '.[test]' && shardfn train" in text
    assert "python -m pytest -q" in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_pages_describe_the_code_as_it_is(page):
    text = page.read_text()
    found = [w for w in ("used to", "an earlier run", "runs since", "DESIGN.md") if w in text]
    assert not found, f"{page.relative_to(ROOT)}: {found}"


def _results_md():
    import importlib.util

    spec = importlib.util.spec_from_file_location("results_md", ROOT / "benchmarks" / "results_md.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_rows_from_the_shapes_benchmarks_write():
    rows_of = _results_md().rows_of
    assert rows_of({"results": [{"a": 1}]}) == [{"a": 1}]
    by_layout = {"steps": 15, "dp2": {"ratio": 0.99, "nested": {"x": 1}}, "fsdp2": {"ratio": 0.95}}
    assert rows_of(by_layout) == [{"name": "dp2", "ratio": 0.99}, {"name": "fsdp2", "ratio": 0.95}]
    by_size = {"sizes": {"S": {"ratio": 0.97}}, "ratios": {"S": 0.97}}
    assert rows_of(by_size) == [{"name": "S", "ratio": 0.97}]
    with pytest.raises(ValueError, match="to tabulate"):
        rows_of({"torch": "2.13"})


def test_results_sections_are_replaced_not_appended():
    results_md = _results_md()
    data = {"results": [{"layout": "dp2", "ratio": 0.99}]}
    new = results_md.section("bench_x", data, command="python b.py", source="benchmarks/results/bench_x.json",
                             machine_words="a CPU", date="2026-12-07")
    text = results_md.replace_section("# Results\n", "bench_x", new)
    again = results_md.replace_section(text, "bench_x", new.replace("0.99", "1.01"))
    assert again.count("<!-- begin bench_x -->") == 1 and "| dp2 | 1.01 |" in again and "0.99" not in again


def test_readme_jit_example_lowers_as_written(clean_process_group):
    """The README's first block, on a simulated mesh (the call that runs it needs 4 ranks:
    examples/jit_layouts.py and tests/test_examples.py run that)."""
    import torch

    text = (ROOT / "README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    mesh = 'sf.Mesh({"dp": 2, "tp": 2})'
    assert mesh in code and "step.lower(params, opt_state, batch)" in code
    code = code.replace(mesh, 'sf.Mesh({"dp": 2, "tp": 2}, fake=True)').split("params, opt_state, loss = step(")[0]
    scope = {"params": {"w1": torch.randn(16, 32), "w2": torch.randn(32, 16)},
             "batch": {"x": torch.randn(8, 16), "y": torch.randn(8, 16)}}
    exec(compile(code, "README.md", "exec"), scope)
    lowered = scope["step"].lower(scope["params"], scope["opt_state"], scope["batch"])
    assert {(c["op"], c["axis"]) for c in lowered.comm_report()} == {("all_reduce", "dp"), ("all_reduce", "tp")}
