"""The reader's path holds together: who imports whom, d3s.py's doctests from the command line, the sizes of the
files a reader opens first (README, d3s.py, the toy, the two trainers), counted as ruff formats them (issue 36), and a
root that shows the design.

- d3s.py imports only torch and the standard library: it is the method, not a framework.
- No rung imports another rung (toy/bandit.py, train_small.py, train_full.py), and nothing that a rung or a shared
  module imports reaches into experiments/: the harness imports the rungs, never the other way round.
"""

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUNGS = {"toy/bandit.py": "bandit", "train_small.py": "train_small", "train_full.py": "train_full"}
SHARED = ["d3s.py"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "support").glob("*.py"))
READER_PATH = {"README.md": 200, "d3s.py": 450, "toy/bandit.py": 380, "train_small.py": 580, "train_full.py": 620}
ROOT_FILES = {
    "README.md",
    "d3s.py",
    "train_small.py",
    "train_full.py",
    "requirements.txt",
    "pyproject.toml",
    ".gitignore",
}
ROOT_FOLDERS = {
    "toy",
    "tests",
    "support",
    "requirements",
    "docs",
    "data",
    "experiments",
    "bench",
    "lesson",
    "integrations",
    "scripts",
    "weights",
    ".ci",
}
STDLIB = set(sys.stdlib_module_names)


def imported(path):
    """Every module a file imports, at any depth of the file (function-level imports included): top-level names."""
    tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
            if node.module == "toy":
                names |= {alias.name for alias in node.names}  # from toy import bandit
    return names


def test_d3s_imports_only_torch_and_the_standard_library():
    assert imported("d3s.py") - STDLIB == {"torch"}


@pytest.mark.parametrize("rung", sorted(RUNGS))
def test_no_rung_imports_another_rung_or_the_experiments(rung):
    others = {module for path, module in RUNGS.items() if path != rung}
    experiments = {p.stem for p in (ROOT / "experiments").glob("*.py")} | {"experiments"}
    found = imported(rung) & (others | experiments)
    assert not found, f"{rung} imports {sorted(found)}"


@pytest.mark.parametrize("module", [m for m in SHARED if (ROOT / m).exists()])
def test_no_shared_module_imports_a_rung_or_the_experiments(module):
    experiments = {p.stem for p in (ROOT / "experiments").glob("*.py")} | {"experiments"}
    found = imported(module) & (set(RUNGS.values()) | experiments)
    assert not found, f"{module} imports {sorted(found)}"


def test_the_import_scan_sees_function_level_and_from_imports(tmp_path):
    probe = ROOT / "tests" / "_layout_probe.py"
    probe.write_text("import os\nfrom toy import bandit\n\ndef f():\n    import train_small\n    from stats import x\n")
    try:
        assert imported("tests/_layout_probe.py") == {"os", "toy", "bandit", "train_small", "stats"}
    finally:
        probe.unlink()


@pytest.mark.figures  # the worked examples' outputs
@pytest.mark.parametrize("module", ["d3s.py", "support/methods.py"])
def test_the_doctests_pass_from_the_command_line(module):
    proc = subprocess.run(
        [sys.executable, "-m", "doctest", module], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def lines_as_formatted(path):
    """The file's line count as `ruff format` (pyproject.toml: line length 120) writes it; a .md file as it is."""
    text = (ROOT / path).read_text(encoding="utf-8")
    if path.endswith(".py"):
        cmd = [sys.executable, "-m", "ruff", "format", "--stdin-filename", path, "-"]
        proc = subprocess.run(cmd, cwd=ROOT, input=text, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == text, f"{path} is not formatted: run ruff format {path}"
    return len(text.splitlines())


@pytest.mark.parametrize("path, most", sorted(READER_PATH.items()))
def test_the_files_a_reader_opens_first_stay_at_the_anchors_scale(path, most):
    """cleanRL's ppo.py is 312 lines, nanoGPT's train.py 336: a feature that would grow these files goes beside them.
    Counted as the formatter writes the file, so packing lines does not make a file shorter."""
    lines = lines_as_formatted(path)
    assert lines <= most, f"{path}: {lines} lines as ruff formats it, more than {most}"


def test_a_packed_file_is_counted_as_the_formatter_unpacks_it(tmp_path):
    """The count cannot be met by packing: a line of three statements is not the file ruff writes."""
    probe = ROOT / "tests" / "_layout_packed.py"
    probe.write_text("x = 1; y = 2; z = 3\n")
    try:
        with pytest.raises(AssertionError, match="is not formatted"):
            lines_as_formatted("tests/_layout_packed.py")
    finally:
        probe.unlink()


def test_the_root_holds_only_the_designs_files_and_folders():
    """The root shows the reading path: d3s.py, the rungs, README, requirements.txt and folders; the modules the rungs
    share are in support/, the other requirements in requirements/."""
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are not known")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    files = {p for p in tracked if "/" not in p}
    folders = {p.split("/")[0] for p in tracked if "/" in p}
    assert files <= ROOT_FILES, f"files at the root beyond the design: {sorted(files - ROOT_FILES)}"
    assert folders <= ROOT_FOLDERS, f"folders at the root beyond the design: {sorted(folders - ROOT_FOLDERS)}"


def test_the_readmes_reading_order_gives_each_files_true_length():
    """The table under "Read it in this order" names each file of the path with its length as formatted: kept true."""
    import re

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text[text.index("## Read it in this order") :].split("\n\n")[1]
    rows = re.findall(r"^\| \d+ \| \[?`([^`]+)`\]?(?:\([^)]*\))? \| (\d+) \|", table, re.M)
    assert [path for path, _ in rows] == list(READER_PATH)
    for path, lines in rows:
        assert int(lines) == lines_as_formatted(path), path
