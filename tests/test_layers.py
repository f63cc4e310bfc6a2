"""Imports point one way: pallas_kernels <- rlkjax <- {serve, train} <- bench (tests may import
anything). Read from the source with `ast`, so an upward import fails here even if no test runs
the line. Prevents: the library depending on its HTTP layer or its learner (the import circle
api <-> serve.engine this replaced), kernels depending on the model."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("pallas_kernels", "rlkjax", "serve", "train", "bench")
# What each package may import from the project (itself included).
ALLOWED = {
    "pallas_kernels": {"pallas_kernels"},
    "rlkjax": {"pallas_kernels", "rlkjax"},
    "serve": {"pallas_kernels", "rlkjax", "serve"},
    "train": {"pallas_kernels", "rlkjax", "train"},
    "bench": {"pallas_kernels", "rlkjax", "serve", "train", "bench"},
}


def project_imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names & set(PACKAGES)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_upward_imports(package):
    bad = {
        str(p.relative_to(ROOT)): sorted(project_imports(p) - ALLOWED[package])
        for p in sorted((ROOT / package).rglob("*.py"))
    }
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"imports against the layering {ALLOWED[package]}: {bad}"


def test_the_check_sees_imports(tmp_path):
    """Not vacuous: both import forms, nested in a function, are found."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from serve.rollout import Server\n    import train.grpo\n")
    assert project_imports(src) == {"serve", "train"}
