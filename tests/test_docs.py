"""The docs cannot drift from the code: what README.md and docs/*.md name exists, and the metric table is generated.

- docs/METRICS.md holds the table ``python -m pe_geometry.analysis.metric_table`` renders, byte for byte;
- README.md stays a walk-through (at most 200 lines); docs/ARCHITECTURE.md lists every module there is;
- the README's option table lists every config group and every option in it, and nothing else;
- every ``group=option`` and every config key the README and the docs name is in ``src/pe_geometry/configs``;
- every ``python <file>.py``, ``python -m <module>`` and ``pe-<script>`` they name exists;
- every relative link (and its ``#anchor``) in README.md, CHANGELOG.md and docs/*.md points at something that exists;
- every test the docs cite (a guarantee names the test that holds it) exists.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
import yaml

import pe_geometry
from pe_geometry.configs import CONFIG_DIR

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIR = Path(pe_geometry.__file__).resolve().parent
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
LINKED_FILES = [README, ROOT / "CHANGELOG.md", *DOCS]
# docs/RELIABILITY.md quotes bad input on purpose (`pe=sinusodal`): its group options are not checked.
OPTION_FILES = [README, *(d for d in DOCS if d.name != "RELIABILITY.md")]
MAX_README_LINES = 200

GROUPS = sorted(str(d.relative_to(CONFIG_DIR)) for d in CONFIG_DIR.rglob("*") if d.is_dir() and any(d.glob("*.yaml")))
KEY_GROUPS = [g for g in GROUPS if "/" not in g and g != "hydra"]  # the groups whose keys are overridden as <group>.<key>


def options(group: str) -> set[str]:
    return {p.stem for p in (CONFIG_DIR / group).glob("*.yaml")}


def code_spans(text: str) -> list[str]:
    """The text of every fenced code block and every inline code span."""
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", text, flags=re.S | re.M)
    prose = re.sub(r"^```[^\n]*\n.*?^```", "", text, flags=re.S | re.M)
    return blocks + re.findall(r"`([^`\n]+)`", prose)


def section(text: str, heading: str) -> str:
    """The text under a ``## heading``, up to the next one."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert match, f"no '## {heading}' section"
    return match.group(1)


# ----------------------------------------------------------------------------- the metric table


def test_the_committed_metric_table_is_the_generated_one():
    from pe_geometry.analysis.metric_table import BEGIN, END, render

    text = (ROOT / "docs" / "METRICS.md").read_text(encoding="utf-8")
    start, end = text.find(BEGIN), text.find(END)
    committed = text[start + len(BEGIN) + 1 : end] if 0 <= start < end else ""
    assert committed, "docs/METRICS.md has lost the metric table's markers"
    assert committed == render(), "the metric table is stale: python -m pe_geometry.analysis.metric_table --write docs/METRICS.md"


# ----------------------------------------------------------------------------- the README


def test_the_readme_is_a_short_walk_through():
    n_lines = len(README.read_text(encoding="utf-8").splitlines())
    assert n_lines <= MAX_README_LINES, f"README.md has {n_lines} lines; move detail to docs/ (at most {MAX_README_LINES})"


def architecture_entries() -> list[str]:
    """Repository paths of docs/ARCHITECTURE.md's module tree (two spaces of indent per level)."""
    block = re.search(r"^```\n(.*?)^```", section(ARCHITECTURE.read_text(encoding="utf-8"), "Modules"), flags=re.S | re.M)
    assert block, "docs/ARCHITECTURE.md's module list has no code block"
    entries, stack = [], []  # stack: (depth, folder path)
    for line in block.group(1).splitlines():
        if not line.strip():
            continue
        depth, name = (len(line) - len(line.lstrip(" "))) // 2, line.split()[0]
        while stack and stack[-1][0] >= depth:
            stack.pop()
        path = stack[-1][1] + name if stack else name
        entries.append(path.rstrip("/"))
        if name.endswith("/"):
            stack.append((depth, path))
    return entries


def test_the_module_list_names_every_module_and_only_real_ones():
    entries = architecture_entries()
    missing_on_disk = [e for e in entries if not (ROOT / e).exists()]
    assert not missing_on_disk, f"docs/ARCHITECTURE.md's module list names paths that do not exist: {missing_on_disk}"
    modules = {str(p.relative_to(ROOT)) for p in PACKAGE_DIR.rglob("*.py")
               if p.name != "__init__.py" and "configs" not in p.relative_to(PACKAGE_DIR).parts}
    modules |= {str(p.relative_to(ROOT)) for p in (PACKAGE_DIR.parent / "hydra_plugins").rglob("*.py") if p.name != "__init__.py"}
    unlisted = sorted(modules - set(entries))
    assert not unlisted, f"modules missing from docs/ARCHITECTURE.md's module list (one line each: what it does): {unlisted}"


def option_table() -> dict[str, list[str]]:
    """The README's option table: group -> the options its second column names."""
    table = {}
    for row in re.findall(r"^\| `([^`]+)` \|([^|]*)\|", section(README.read_text(encoding="utf-8"), "Options"), flags=re.M):
        group, cell = row
        table[group] = re.findall(r"`([^`]+)`", cell)
    return table


def test_the_option_table_lists_every_group_and_every_option():
    table = option_table()
    assert sorted(table) == GROUPS, "the README's option table and the config groups differ"
    for group, named in table.items():
        assert sorted(named) == sorted(options(group)), f"README option table, group {group}: {named} vs {sorted(options(group))}"


# ----------------------------------------------------------------------------- what the README and docs name


GROUP_OPTION = re.compile(rf"(?<![\w.+~/-])({'|'.join(re.escape(g) for g in sorted(GROUPS, key=len, reverse=True))})=([\w,]+)")
DOTTED_KEY = re.compile(rf"(?<![\w.+~/$-])((?:{'|'.join(KEY_GROUPS)})(?:\.\w+)+)(=?)")


@pytest.mark.parametrize("doc", OPTION_FILES, ids=lambda p: p.name)
def test_every_group_option_named_exists(doc):
    named = {(g, o) for span in code_spans(doc.read_text(encoding="utf-8"))
             for g, values in GROUP_OPTION.findall(span) for o in values.split(",") if o}
    unknown = sorted(f"{g}={o}" for g, o in named if o not in options(g))
    assert not unknown, f"{doc.name} names options that are not in src/pe_geometry/configs: {unknown}"


def has_key(group: str, keys: list[str]) -> bool:
    """Whether some option of ``group`` has the nested key ``keys``: a yaml's own keys and its classes' settings (the
    stored nodes its defaults list extends), not the other groups its defaults list picks."""
    from pe_geometry.settings import defaults, settings_of

    def with_settings(node):
        if isinstance(node, dict):
            settings = settings_of(str(node.get("_target_", "")))
            node = {**(defaults(settings) if settings else {}), **{k: with_settings(v) for k, v in node.items()}}
        return node

    for path in (CONFIG_DIR / group).glob("*.yaml"):
        node = with_settings(yaml.safe_load(path.read_text()) or {})
        if path.read_text().startswith("# @package _global_") and group in node:
            node = node[group]  # an option that overrides other groups too (model=xtransformers) keeps its own keys here
        for key in keys:
            if not isinstance(node, dict) or key not in node:
                break
            node = node[key]
        else:
            return True
    return False


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_every_config_key_named_exists(doc):
    """Every ``<group>.<key>`` in the README, and every ``<group>.<key>=`` override in the docs (which also name
    Python attributes such as ``model.W_E``), is a key of some option of that group."""
    found = set()
    for span in code_spans(doc.read_text(encoding="utf-8")):
        found |= {key for key, assigned in DOTTED_KEY.findall(span) if (assigned or doc == README) and not key.endswith(".py")}
    unknown = sorted(k for k in found if not has_key(k.split(".")[0], k.split(".")[1:]))
    assert not unknown, f"{doc.name} names config keys no option has: {unknown}"


def console_scripts() -> set[str]:
    """The names in pyproject.toml's ``[project.scripts]`` (read as text: tomllib is Python 3.11+)."""
    text = (ROOT / "pyproject.toml").read_text()
    table = re.search(r"^\[project\.scripts\]\n(.*?)(?=^\[|\Z)", text, flags=re.S | re.M)
    assert table, "pyproject.toml has no [project.scripts]"
    return set(re.findall(r"^([\w-]+)\s*=", table.group(1), flags=re.M))


COMMAND = re.compile(r"(?<![\w/.-])(?:python3? +(-m +[\w.]+|[\w./-]+\.py)|(pe-[a-z]+))(?![\w-])")


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_every_command_named_exists(doc):
    scripts = console_scripts()
    missing = set()
    for span in code_spans(doc.read_text(encoding="utf-8")):
        for target, script in COMMAND.findall(span):
            if script:
                if script not in scripts:
                    missing.add(script)
            elif target.startswith("-m"):
                module = target.split()[-1]
                if importlib.util.find_spec(module) is None:
                    missing.add(f"python -m {module}")
            elif not (ROOT / target).is_file():
                missing.add(f"python {target}")
    assert not missing, f"{doc.name} names commands that do not exist: {sorted(missing)}"


# ----------------------------------------------------------------------------- links


def anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a markdown file's headings."""
    out = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", markdown, flags=re.S | re.M), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


@pytest.mark.parametrize("doc", LINKED_FILES, ids=lambda p: p.name)
def test_every_relative_link_points_at_something_that_exists(doc):
    text = doc.read_text(encoding="utf-8")
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        path = (doc.parent / path_part).resolve() if path_part else doc
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path.read_text(encoding="utf-8")):
            broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)} links to what does not exist: {broken}"


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.name)
def test_every_test_the_docs_cite_exists(doc):
    """A guarantee cites the test that holds it (``test_sigkill_then_resume_...``): that test, or test file, exists."""
    test_files = list((ROOT / "tests").glob("test_*.py"))
    defined = {name for path in test_files for name in re.findall(r"^\s*def (test_\w+)", path.read_text(), flags=re.M)}
    files = {path.stem for path in test_files}
    cited = set(re.findall(r"(?<![\w.])(test_\w+)", doc.read_text(encoding="utf-8")))
    missing = sorted(cited - defined - files)
    assert not missing, f"{doc.name} cites tests that do not exist: {missing}"


# ----------------------------------------------------------------------------- stated durations

DURATION = re.compile(r"\b\d[\d.,]*\s*(?:-\s*\d[\d.,]*\s*)?(?:min|minutes?|h|hours?)\b|\ban hour\b|\b(?:several|a few) minutes\b")
MACHINE = re.compile(r"vCPU|CPU|cores?\b|GPU|H100|H200")
LOAD = re.compile(r"idle|shared|alone|other jobs|loaded")


def statements(text: str) -> list[str]:
    """README sentences and YAML comment lines: the units a stated duration must carry its conditions in."""
    joined = re.sub(r"\n(?![\n#`|-])", " ", text)  # re-join a wrapped paragraph; keep code and comment lines apart
    return [s for line in joined.splitlines() for s in re.split(r"(?<=[.;])\s+(?=[A-Z(])", line)]


def test_every_stated_duration_names_its_machine_and_load():
    """A new user measured 24 min for "about 8 minutes" and 15 min for "several minutes": each time says where it held.
    The README and every config file in one test: the failure lists each file's vague durations."""
    paths = [README, *sorted(CONFIG_DIR.rglob("*.yaml"))]
    vague = {str(path.relative_to(ROOT)): found for path in paths
             if (found := [s.strip() for s in statements(path.read_text())
                           if DURATION.search(s) and not (MACHINE.search(s) and LOAD.search(s))])}
    assert len(paths) > 10 and not vague, f"durations without the machine and its load: {vague}"


def test_the_readme_test_commands_state_their_durations():
    commands = [line for line in section(README.read_text(), "Tests").splitlines() if line.startswith("python -m pytest")]
    assert len(commands) == 2 and all(DURATION.search(line) for line in commands), commands
