"""The package's shape: `import influkit` loads the core only; no import circle; the core never imports a method."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import import_graph  # noqa: E402

HEAVY = ("h5py", "pandas", "scipy", "matplotlib", "transformers")


def _run(code: str) -> dict:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_influkit_loads_no_optional_dependency_and_no_method_package():
    loaded = _run(
        "import json, sys, influkit as ik; "
        "ik.Chain, ik.Stage, ik.score, ik.influence, ik.SolveConfig; "
        "print(json.dumps({'heavy': [m for m in %r if m in sys.modules], "
        "'influkit': sorted(m for m in sys.modules if m.startswith('influkit')), 'file': ik.__file__}))" % (HEAVY,)
    )
    assert loaded["file"].startswith(str(ROOT))
    assert loaded["heavy"] == []
    methods = [m for m in loaded["influkit"] if import_graph.is_method(m)]
    assert methods == []


def test_method_packages_load_on_first_use():
    loaded = _run(
        "import json, sys, influkit as ik; before = 'influkit.ssl' in sys.modules; ik.ssl.hypergradient; "
        "ik.turnover.VolatileMasks; ik.validation.pearson; "
        "print(json.dumps({'before': before, 'after': [m in sys.modules for m in "
        "('influkit.ssl', 'influkit.turnover', 'influkit.validation')]}))"
    )
    assert loaded == {"before": False, "after": [True, True, True]}
    import influkit as ik

    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        ik.nonexistent  # noqa: B018
    assert {"ssl", "turnover", "elmo", "hf", "validation", "apps"} <= set(dir(ik))
    assert set(ik._LAZY) <= set(ik.__all__)  # every lazy package is public


def test_lazy_packages_are_imported_for_type_checkers():
    """``if TYPE_CHECKING:`` imports every lazy package, so a type checker sees ``ik.unrolled`` as the module."""
    import ast

    import influkit as ik

    tree = ast.parse((ROOT / "influkit" / "__init__.py").read_text())
    guarded = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    names = {alias.name for node in guarded for stmt in node.body if isinstance(stmt, ast.ImportFrom)
             for alias in stmt.names}
    assert names == set(ik._LAZY)


def test_the_cli_loads_the_digits_experiment_on_demand():
    """``influkit score`` or ``index`` never loads the digits app: the CLI reads only its constants at load."""
    loaded = _run("import json, sys, influkit.cli; "
                  "print(json.dumps(sorted(m for m in sys.modules if m.startswith('influkit.apps'))))")
    assert loaded == ["influkit.apps", "influkit.apps.demo_defaults"]


def test_import_graph_has_no_circle():
    assert import_graph.circles(import_graph.edges(ROOT)) == []


def test_core_imports_nothing_outside_the_core():
    """No arrow from the core to a method/application package, nor to the presets and tools built on it."""
    graph = import_graph.edges(ROOT)
    assert any(import_graph.is_core(a) for a, _, _ in graph)  # the walker sees the core
    assert import_graph.core_arrows(graph) == []


def test_the_walker_finds_circles_and_forbidden_arrows():
    """The checks can fail: a planted circle and planted arrows out of the core are reported."""
    graph = [("influkit.chain", "influkit.ssl.trainer", True), ("influkit.ssl.trainer", "influkit.chain", False),
             ("influkit.ssl", "influkit.ssl.trainer", False), ("influkit.ssl.trainer", "influkit.ssl", False),
             ("influkit.solvers", "influkit.report", False), ("influkit.report", "influkit.solvers", False)]
    assert sorted(import_graph.circles(graph)) == [["influkit.chain", "influkit.ssl.trainer"],
                                                   ["influkit.report", "influkit.solvers"]]
    assert import_graph.core_arrows(graph) == [("influkit.chain", "influkit.ssl.trainer", True),
                                               ("influkit.solvers", "influkit.report", False)]


@pytest.mark.parametrize("package, arrow", [
    ("benchmarks", ("benchmarks.bench_core", "benchmarks.common", False)),
    ("studies", ("studies.fidelity", "studies.fidelity_tasks", False)),
])
def test_benchmarks_and_studies_are_packages_without_circles_or_path_edits(package, arrow):
    """``python -m benchmarks.bench_core``, ``python -m studies.fidelity``: the modules import each other as a
    package, in no circle, and none edits sys.path to find its siblings."""
    assert (ROOT / package / "__init__.py").exists()
    graph = import_graph.edges(ROOT, package)
    assert arrow in graph  # the walker sees the package
    assert import_graph.circles(graph) == []
    assert import_graph.path_edits(ROOT, package) == []


def test_the_walker_finds_sibling_circles_and_path_edits(tmp_path):
    """Planted: two script-style siblings importing each other (one lazily) and a sys.path edit are reported."""
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "a.py").write_text("import sys\nsys.path.insert(0, '.')\nfrom b import f\n")
    (tmp_path / "benchmarks" / "b.py").write_text("def f():\n    from a import g\n")
    graph = import_graph.edges(tmp_path, "benchmarks")
    assert import_graph.circles(graph) == [["benchmarks.a", "benchmarks.b"]]
    assert import_graph.path_edits(tmp_path, "benchmarks") == ["benchmarks.a"]


def test_check_script_exits_zero_on_this_tree():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "import_graph.py"), "--check"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stdout
    assert "import circles: 0" in out.stdout


def test_every_file_path_is_its_module_name_and_each_module_loads_once():
    """``influkit/chain.py`` is ``influkit.chain``: importing a module by its path gives the object the package
    exports (no second copy), and every .py file under influkit/ maps to the dotted name of its path."""
    loaded = _run(
        "import json, influkit, influkit.chain, influkit.unrolled.watch, influkit.factored.fit as fc; "
        "import influkit.index.gradient_index as gi; "
        "print(json.dumps({'same': influkit.chain.Chain is influkit.Chain, "
        "'files': [m.__file__ for m in (influkit.chain, influkit.unrolled.watch, fc, gi)], "
        "'path': list(influkit.__path__)}))"
    )
    assert loaded["same"]
    assert loaded["path"] == [str(ROOT / "influkit")]
    assert [Path(f).relative_to(ROOT).as_posix() for f in loaded["files"]] == [
        "influkit/chain.py", "influkit/unrolled/watch.py", "influkit/factored/fit.py",
        "influkit/index/gradient_index.py"]
    for name, path in import_graph.modules(ROOT).items():
        expected = path.relative_to(ROOT).with_suffix("").as_posix().removesuffix("/__init__").replace("/", ".")
        assert name == expected


def test_the_import_contract_names_only_modules_that_exist():
    """Every module the contract declares core is a file or package of influkit (a renamed module cannot drop out
    of the contract silently), and every method package is outside it."""
    for name in import_graph.CORE:
        assert (ROOT / "influkit" / f"{name}.py").exists() or (ROOT / "influkit" / name / "__init__.py").exists(), name
    for name in ("ssl", "turnover", "unrolled", "elmo", "index", "hf", "validation", "apps", "report", "cli", "jobs"):
        assert import_graph.part(f"influkit.{name}") == "method"


def test_the_tests_import_neither_benchmarks_nor_studies():
    """The lab's own tests live beside it (benchmarks/tests, studies/tests); tests/ checks the package alone."""
    import ast

    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
            found += [f"{path.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in ("benchmarks", "studies")]
    assert found == []
