"""The package layers, read from the source with `ast` (imports inside functions count too):
kernels/ imports nothing of ours; rollout/, pipelines/ and trainers/ never import loop/;
trainers/ does not import rollout/ (the loop composes them); only the Ray launch code imports
Ray; no comment or docstring points at a path outside the repository; the manifest file name,
the logprobs modes and the file hash are each defined once."""

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


def _defines(path: Path):
    """(where, kind) for each shared definition in `path`: a module-level manifest file name
    ("*manifest.json"), a literal tuple of logprobs modes, or a function that hashes a file
    (calls hashlib's sha256 and reads a file)."""
    tree = ast.parse(path.read_text(), str(path))
    for node in tree.body:
        if isinstance(node, ast.Assign):
            v = node.value
            if isinstance(v, ast.Constant) and isinstance(v.value, str) and v.value.endswith("manifest.json"):
                yield f"{path.relative_to(REPO)}:{node.lineno}", "manifest name"
            if isinstance(v, ast.Tuple) and any(isinstance(e, ast.Constant) and e.value == "raw_logprobs" for e in v.elts):
                yield f"{path.relative_to(REPO)}:{node.lineno}", "logprobs modes"
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            called = {ast.unparse(c.func).split(".")[-1] for c in ast.walk(fn) if isinstance(c, ast.Call)}
            if "sha256" in called and called & {"open", "read_bytes"}:
                yield f"{path.relative_to(REPO)}:{fn.lineno}", "file hash"


def test_shared_names_are_defined_once():
    """One manifest file name, one list of logprobs modes, one file hash: the others import them."""
    found: dict[str, list[str]] = {}
    for pkg in OURS:
        for p in sorted((REPO / pkg).rglob("*.py")):
            for where, kind in _defines(p):
                found.setdefault(kind, []).append(where)
    assert {k: len(v) for k, v in found.items()} == {"manifest name": 1, "logprobs modes": 1, "file hash": 1}, found
