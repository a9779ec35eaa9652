"""Write pip constraints that pin every direct dependency of pyproject.toml to its floor.

    python .ci/lowest_constraints.py dev > constraints.txt
    pip install -c constraints.txt -e ".[dev]"

The base dependencies and those of the named extras (and of the extras they name in turn,
``pe-geometry[all]``) become ``name==floor`` lines, the floor being the version after ``>=`` (or ``==``).
Transitive dependencies are left to pip's resolver. A direct dependency without a floor is an error:
the lowest-versions CI job could not prove anything about it.
Standard library only (runs before anything is installed); Python 3.11+ for tomllib.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"
# name[extras] specifiers ; marker  (PEP 508, the subset pyproject.toml uses: no URLs)
REQUIREMENT = re.compile(r"^\s*(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[(?P<extras>[^\]]*)\])?\s*(?P<spec>[^;]*)(?:;.*)?$")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def floor(spec: str) -> str | None:
    """The lowest version a specifier set allows, if it says one: ``>=2.6,<2.7`` -> ``2.6``; ``==3.0.0`` -> ``3.0.0``."""
    for part in spec.split(","):
        match = re.fullmatch(r"\s*(>=|==|~=)\s*([^\s,*]+)\s*", part)
        if match:
            return match.group(2)
    return None


def requirements(project: dict, extras: list[str]) -> dict[str, tuple[str, str]]:
    """{normalised name: (specifier, floor)} for the base dependencies plus ``extras``, following self-references."""
    own = normalise(project["name"])
    optional = project.get("optional-dependencies", {})
    found: dict[str, tuple[str, str]] = {}
    todo, seen = [None, *extras], set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        if extra is not None and extra not in optional:
            raise SystemExit(f"error: pyproject.toml has no extra {extra!r} (it has {', '.join(sorted(optional))})")
        for line in project["dependencies"] if extra is None else optional[extra]:
            match = REQUIREMENT.match(line)
            if match is None:
                raise SystemExit(f"error: cannot read the requirement {line!r}")
            name = normalise(match["name"])
            if name == own:  # pe-geometry[report,wandb]: the extras it names
                todo.extend(e.strip() for e in (match["extras"] or "").split(",") if e.strip())
                continue
            low = floor(match["spec"])
            if low is None:
                raise SystemExit(f"error: {line!r} has no floor (>=, == or ~=): the lowest-versions job cannot pin it")
            found[name] = (match["spec"].strip(), low)
    return found


def main(argv: list[str]) -> None:
    import tomllib  # Python 3.11+ (CI's); tests/test_packaging.py imports this file on any Python

    project = tomllib.loads(PYPROJECT.read_text())["project"]
    print(f"# lowest allowed versions of the direct dependencies (.ci/lowest_constraints.py {' '.join(argv)})")
    for name, (spec, low) in sorted(requirements(project, argv).items()):
        print(f"{name}=={low}  # {spec}")


if __name__ == "__main__":
    main(sys.argv[1:])
