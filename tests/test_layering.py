"""The package layers, read from the source with `ast` (imports inside functions count too):
kernels/ < rollout/ < pipelines/ < trainers/ < loop/; kernels/ imports nothing of ours; rollout/
imports only kernels/; trainers/ does not import rollout/ (the loop composes them) but for its
leaves `rollout.artifacts` (manifest and hashes) and `rollout.messages`; no import circle among loop/'s modules; only the Ray launch code imports
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
    "rollout": {"loop", "pipelines", "trainers"},
    "pipelines": {"loop", "trainers"},
    "trainers": {"loop", "rollout"},
}


LEAVES = {"rollout.artifacts", "rollout.messages"}  # stdlib-only modules any layer may import


def modules(path: Path) -> set[str]:
    """Dotted module names `path` imports anywhere in its body (`from a import b`: a.b and a)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return out


def imports(path: Path) -> set[str]:
    """Top-level package names `path` imports anywhere in its body, the shared leaves aside."""
    mods = modules(path)
    leaves = {m for m in mods if m in LEAVES or any(m.startswith(x + ".") for x in LEAVES)}
    return {m.split(".")[0] for m in mods - leaves if not any(x.startswith(m + ".") for x in leaves)}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_packages_import_only_the_layers_below(package):
    bad = {str(p.relative_to(REPO)): sorted(imports(p) & FORBIDDEN[package])
           for p in sorted((REPO / package).rglob("*.py"))}
    assert not {k: v for k, v in bad.items() if v}, bad


def test_the_shared_leaves_import_nothing_of_ours():
    for leaf in LEAVES:
        assert not imports(REPO / (leaf.replace(".", "/") + ".py")) & set(OURS), leaf


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle in `graph` (module -> modules it imports), or []."""
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        state[m] = 2
        path.pop()
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_the_cycle_finder_sees_a_circle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_loop_has_no_import_circle():
    """loop/'s modules import each other as a tree: config composes, the CLI edge loads it."""
    names = {p.stem for p in (REPO / "loop").glob("*.py")}
    graph = {p.stem: {m.split(".")[1] for m in modules(p) if m.startswith("loop.") and m.split(".")[1] in names} - {p.stem}
             for p in (REPO / "loop").glob("*.py")}
    assert not _cycle(graph), " -> ".join(_cycle(graph))


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
