"""The documents describe code that exists: README.md and docs/*.md link only to files and headings that exist,
docs/map.md lists every file of the repository and nothing else, every `python -m MODULE --flag` they or a module
docstring print names a module and flags that exist, the README's Python example runs as printed, and every `>>>`
example in a docstring runs and prints what it shows. Prevents: a moved file, a renamed flag or a changed API
leaving the front page, the map or a docstring describing code that is gone."""

import ast
import doctest
import importlib
import importlib.util
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import rlkjax
from rlkjax.text.chat import load_chat_template
from rlkjax.text.tokenizer import load_tokenizer
from rlkjax.tiny_qwen3 import write_tiny_qwen3
from tests.server_process import ADMIN, start_server

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ("pallas_kernels", "rlkjax", "serve", "train", "bench")  # the product's Python packages
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def repository_files() -> set[str]:
    """Every file of the checkout that git does not ignore (committed or not), as a path from the root."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    return {path for path in listed if (ROOT / path).is_file()}


def mapped_files() -> set[str]:
    """The files that docs/map.md links to, as paths from the root."""
    text = (ROOT / "docs/map.md").read_text()
    targets = {(ROOT / "docs" / t).resolve() for t in LINK.findall(text) if "://" not in t and "#" not in t}
    return {str(t.relative_to(ROOT)) for t in targets if t.is_file()}


def needs_a_map_line(path: str) -> bool:
    """Files docs/map.md must list one by one: all but the measurements (bench/results/, listed by its own
    index) and the test fixtures' checkpoint files (tests/fixtures/, one line for the folder)."""
    return not path.startswith(("bench/results/", "tests/fixtures/"))


def test_the_map_lists_every_file_and_only_files_that_exist():
    text = (ROOT / "docs/map.md").read_text()
    missing_targets = [t for t in LINK.findall(text) if "://" not in t and not (ROOT / "docs" / t).exists()]
    assert missing_targets == [], f"docs/map.md links to files that do not exist: {missing_targets}"
    unlisted = sorted(p for p in repository_files() - mapped_files() if needs_a_map_line(p))
    assert unlisted == [], f"add a line for each to docs/map.md: {unlisted}"


def heading_anchors(markdown: str) -> set[str]:
    """GitHub's anchors of a document's headings: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for line in markdown.splitlines():
        if m := re.match(r"#+ (.*)", line):
            anchors.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return anchors


def without_code_blocks(markdown: str) -> str:
    return re.sub(r"```.*?```", "", markdown, flags=re.DOTALL)


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(document):
    """Each relative link points at a file or folder that exists, and a `#anchor` at a heading of its page."""
    broken = []
    for target in LINK.findall(without_code_blocks(document.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = (document.parent / path).resolve() if path else document
        if not resolved.exists():
            broken.append(target)
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved.read_text()):
            broken.append(target)
    assert broken == [], f"{document.relative_to(ROOT)}: {broken}"


def test_the_readme_fits_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


# ----- commands: every `python -m MODULE --flag` printed names a module and flags that exist -----
COMMAND = re.compile(r"python -m ([A-Za-z_][\w.]*)([^`\n#|&;)]*)")


def module_docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def printed_commands() -> dict[str, set[str]]:
    """Module -> the long flags printed with it, over README.md, docs/*.md and the product's module docstrings.
    Continuation lines are joined; quoted values (`--server-flags="--no-warmup ..."`) are not read as flags."""
    texts = [d.read_text() for d in DOCUMENTS]
    texts += [module_docstring(ROOT / p) for p in sorted(repository_files()) if p.endswith(".py")]
    commands: dict[str, set[str]] = {}
    for text in texts:
        for module, rest in COMMAND.findall(text.replace("\\\n", " ")):
            module = module.rstrip(".")
            rest = re.sub(r"\"[^\"]*\"|'[^'\n]*'", "", rest)
            flags = {t.split("=")[0] for t in rest.split() if re.fullmatch(r"--[a-z][a-z0-9-]*(=.*)?", t)}
            commands.setdefault(module, set()).update(flags)
    return commands


def ours(module: str) -> bool:
    return module.split(".")[0] in (*PACKAGES, "tests")


COMMANDS = printed_commands()


def test_every_printed_module_exists():
    missing = [m for m in COMMANDS if ours(m) and importlib.util.find_spec(m) is None]
    assert missing == [], f"`python -m` of modules that do not exist: {missing}"
    assert {"train.grpo", "train.sft", "serve.rollout", "bench.mismatch"} <= set(COMMANDS)  # the reader finds them


def help_text(module: str) -> str:
    """`python -m MODULE --help`'s output, wide enough that no flag is wrapped."""
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"],
        cwd=ROOT,
        env=os.environ | {"COLUMNS": "400", "JAX_PLATFORMS": "cpu"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow  # a process per module, each importing JAX: about 3 s each
@pytest.mark.parametrize("module", sorted(m for m, flags in COMMANDS.items() if ours(m) and flags))
def test_every_printed_flag_is_in_the_module_s_help(module):
    text = help_text(module)
    unknown = sorted(f for f in COMMANDS[module] if not re.search(re.escape(f) + r"(?![\w-])", text))
    assert unknown == [], f"python -m {module}: flags printed in the documents but not in --help: {unknown}"


# ----- the README's Python example, as printed -----
@pytest.mark.slow  # a generate and a score of qwen3-tiny, compiled in interpret mode: about 20 s
def test_the_readme_s_python_example_runs(tmp_path, monkeypatch):
    text = (ROOT / "README.md").read_text()
    block = text[text.index("```python\n") + len("```python\n") :]
    block = block[: block.index("```")]
    assert "rlkjax.generate" in block and "rlkjax.score" in block
    monkeypatch.chdir(tmp_path)  # it writes a checkpoint to out_dir
    exec(compile(block, "README.md", "exec"), {})
    assert (tmp_path / "out_dir" / "config.json").is_file()


# ----- `>>>` examples in docstrings -----
def modules_with_examples() -> list[str]:
    """The product's modules with a `>>>` example in any docstring."""
    return sorted(
        path.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        for path in repository_files()
        if path.endswith(".py") and path.split("/")[0] in PACKAGES and ">>>" in (ROOT / path).read_text()
    )


SERVER_EXAMPLES = {"rlkjax.client"}  # their examples talk to a running server


@pytest.fixture(scope="module")
def qwen3_text(tmp_path_factory):
    """The names the examples take from a checkpoint: Qwen3's real tokenizer and chat template."""
    tokenizer = load_tokenizer(write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3")))
    return {"tokenizer": tokenizer, "template": load_chat_template(tokenizer)}


@pytest.fixture
def server_names(tiny, tmp_path):
    """The names the client's examples take: a real server's url and admin key, and a checkpoint to load."""
    cfg, _ = tiny
    rlkjax.save_hf_checkpoint(tmp_path / "v1", cfg, rlkjax.init_params(cfg, seed=1))
    proc, client = start_server()
    yield {"url": client.url, "admin_key": ADMIN, "checkpoint": str(tmp_path / "v1")}
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)


def test_the_examples_are_found():
    assert {"rlkjax.client", "rlkjax.rl.environments", "rlkjax.rl.tools"} <= set(modules_with_examples())


@pytest.mark.parametrize(
    "name",
    [pytest.param(m, marks=pytest.mark.slow) if m in SERVER_EXAMPLES else m for m in modules_with_examples()],
)
def test_every_docstring_example_runs(name, request, qwen3_text):
    names = request.getfixturevalue("server_names") if name in SERVER_EXAMPLES else qwen3_text
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder(exclude_empty=True).find(module, globs=vars(module) | names):
        runner.run(test)
    results = runner.summarize(verbose=False)
    assert results.attempted > 0 and results.failed == 0, f"{name}: {results} (the report is above)"
