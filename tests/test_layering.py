"""The package layers, read from the source with `ast` (imports inside functions count too):
kernels/ imports nothing of ours; rollout/, pipelines/ and trainers/ never import loop/;
trainers/ does not import rollout/ (the loop composes them); only the Ray launch code imports
Ray; no comment or docstring points at a path outside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
OUTSIDE = re.compile(r"/wor[k]/|\.\./shared")  # this workplace's folders beside the repository
OURS = ("kernels", "rollout", "pipelines", "trainers", "loop")
FORBIDDEN = {
    "kernels": set(OURS) - {"kernels"},
    "rollout": {"loop"},
    "pipelines": {"loop"},
    "trainers": {"loop", "rollout"},
}


def imports(path: Path) -> set[str]:
    """Top-level package names `path` imports anywhere in its body."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_the_layers_below(package):
    bad = {str(p.relative_to(REPO)): sorted(imports(p) & FORBIDDEN[package])
           for p in sorted((REPO / package).rglob("*.py"))}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_only_the_ray_launch_code_imports_ray():
    users = [str(p.relative_to(REPO)) for pkg in OURS for p in sorted((REPO / pkg).rglob("*.py")) if "ray" in imports(p)]
    assert all("launch" in u or u.startswith("infra/") for u in users), users


def test_no_comment_points_outside_the_repository():
    hits = [f"{p.relative_to(REPO)}:{i}" for pkg in (*OURS, "bench", "conf", "tests")
            for p in sorted((REPO / pkg).rglob("*")) if p.suffix in (".py", ".yaml", ".md") and p.name != "test_layering.py"
            for i, line in enumerate(p.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, hits
