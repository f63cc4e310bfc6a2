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


def rlkjax_wings_imported(path: Path) -> set[str]:
    """The wings of rlkjax a module imports: `rlkjax.core` from `from rlkjax.core.model import x`,
    `from rlkjax.core import model` or `import rlkjax.core.model`; `rlkjax` for the package's door itself
    (`import rlkjax`, `from rlkjax import generate`) and its top-level modules (api, client, ...)."""
    wings = set()
    for node in ast.walk(ast.parse(path.read_text())):
        modules = []
        if isinstance(node, ast.Import):
            modules = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        elif isinstance(node, ast.ImportFrom) and node.level == 1:
            modules = [f"rlkjax.{path.parent.name}"]  # `from .config import x` stays inside its wing
        for name in modules:
            parts = name.split(".")
            if parts[0] != "rlkjax":
                continue
            wings.add(f"rlkjax.{parts[1]}" if len(parts) > 1 and parts[1] in WINGS else "rlkjax")
    return wings


@pytest.mark.parametrize("package", PACKAGES)
def test_no_upward_imports(package):
    bad = {
        str(p.relative_to(ROOT)): sorted(project_imports(p) - ALLOWED[package])
        for p in sorted((ROOT / package).rglob("*.py"))
    }
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"imports against the layering {ALLOWED[package]}: {bad}"


# rlkjax's wings and what each may import of rlkjax (itself included); pallas_kernels is checked above.
WINGS = {
    "core": {"rlkjax.core"},
    "engine": {"rlkjax.core", "rlkjax.engine"},
    "rl": {"rlkjax.rl"},
    "text": {"rlkjax.core", "rlkjax.text"},
}


def test_rlkjax_has_wings_and_a_door():
    """rlkjax/ holds its wings and only the public door beside them (the package's __init__, api, client,
    the entry points' shared config, the tiny model writer): a new module finds its wing."""
    top = sorted(p.name for p in (ROOT / "rlkjax").glob("*.py"))
    assert top == ["__init__.py", "api.py", "client.py", "entry_config.py", "tiny_qwen3.py"]
    assert sorted(p.name for p in (ROOT / "rlkjax").iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        WINGS
    )


@pytest.mark.parametrize("wing", sorted(WINGS))
def test_each_wing_imports_only_what_its_rule_allows(wing):
    """core imports only the kernels; engine only core; rl nothing else of rlkjax; text only core. Prevents:
    the model reaching the engine, the engine reaching rewards or tokenizers, a reward reaching the model."""
    bad = {
        str(p.relative_to(ROOT)): sorted(rlkjax_wings_imported(p) - WINGS[wing])
        for p in sorted((ROOT / "rlkjax" / wing).rglob("*.py"))
    }
    bad = {k: v for k, v in bad.items() if v}
    assert not bad, f"rlkjax/{wing} may import {sorted(WINGS[wing])} of rlkjax: {bad}"


def test_the_wing_check_sees_imports(tmp_path):
    """Not vacuous: every import form of a wing, and the door, is found."""
    src = tmp_path / "m.py"
    src.write_text(
        "import rlkjax\nfrom rlkjax.engine import programs\n"
        "def f():\n    from rlkjax.rl.tools import Tools\n    import rlkjax.text.chat\n    from rlkjax import api\n"
    )
    assert rlkjax_wings_imported(src) == {"rlkjax", "rlkjax.engine", "rlkjax.rl", "rlkjax.text"}


def test_the_check_sees_imports(tmp_path):
    """Not vacuous: both import forms, nested in a function, are found."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from serve.rollout import Server\n    import train.grpo\n")
    assert project_imports(src) == {"serve", "train"}


def engine_reaches(path: Path) -> list[str]:
    """`x.engine.<attr>` and `x.in_flight` in a module: the engine's state read around the engine client."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Attribute):
            continue
        inner = node.value
        if node.attr == "in_flight" or (isinstance(inner, ast.Attribute) and inner.attr == "engine"):
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_only_the_engine_client_reaches_the_engine(tmp_path):
    """serve's routes and server talk to the engine through serve/engine_client.py only: no other module
    reads `something.engine.<attr>` or a set of requests in flight (as `server.engine.config.max_batch`
    and `server.in_flight.difference_update` once did from four modules). Not vacuous: a module that
    does is caught."""
    modules = sorted(p for p in (ROOT / "serve").glob("*.py") if p.name != "engine_client.py")
    assert {p.name for p in modules} >= {"server.py", "openai_api.py", "protocol.py", "token_route.py"}
    assert [hit for p in modules for hit in engine_reaches(p)] == []
    src = tmp_path / "m.py"
    src.write_text("def f(server):\n    server.in_flight.clear()\n    return server.engine.config.max_batch\n")
    assert len(engine_reaches(src)) == 2


PRODUCT = ("pallas_kernels", "rlkjax", "serve", "train")
MOST_POSITIONAL = 8


def long_signatures(path: Path) -> list[str]:
    """`file:line name(N)` for each function or lambda in a module with more than MOST_POSITIONAL positional
    parameters (positional-only and ordinary ones; keyword-only ones after `*` or `*args` do not count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            count = len(node.args.posonlyargs) + len(node.args.args)
            if count > MOST_POSITIONAL:
                found.append(f"{path.name}:{node.lineno} {getattr(node, 'name', 'lambda')}({count})")
    return found


def test_no_product_function_takes_more_than_eight_positional_parameters(tmp_path):
    """Every function in pallas_kernels/, rlkjax/, serve/ and train/ (methods, nested functions and lambdas
    included; `self` counts) takes at most 8 positional parameters; keyword-only parameters (after `*`) do not
    count. Static program settings travel as one hashable value (programs.Decoding, model.LearnerPass,
    loss.Objective), per-call arrays as one pytree (model.Sequences, programs.RowSampling). Prevents: the
    13-name lists `next_round` and `sequence_logprobs` once repeated at every call site. Not vacuous: a
    module with a nine-parameter function, method and lambda is caught, keyword-only ones are not."""
    modules = [p for package in PRODUCT for p in sorted((ROOT / package).rglob("*.py"))]
    assert len(modules) > 50
    assert [hit for p in modules for hit in long_signatures(p)] == []
    src = tmp_path / "m.py"
    src.write_text(
        "def f(a, b, c, d, e, f, g, h, i): ...\n"
        "class C:\n    def m(self, a, b, c, d, e, f, g, h): ...\n"
        "g = lambda a, b, c, d, e, f, g, h, /, i: 0\n"
        "def fine(a, b, c, d, e, f, g, h, *, i, j): ...\n"
        "def rest(a, b, c, d, e, f, g, h, *more, i): ...\n"
    )
    assert [hit.split()[1] for hit in long_signatures(src)] == ["f(9)", "m(9)", "lambda(9)"]
