"""`pip install .` (and so `pip install git+URL`) installs the method, d3s.py, as the module `d3s`, torch its one
dependency, so that another trainer's environment can `import d3s` (issue 54, item 6). The rungs, support/ and the
rest stay scripts run from the repository: the installed distribution holds d3s.py and nothing else.

Offline: the fresh venv sees the shared venv's packages (torch, and setuptools, the build backend that pyproject.toml
names) through a .pth file, and pip runs with --no-deps --no-build-isolation --no-index, so nothing is downloaded. The
repository is copied first (as `pip install git+URL` clones it): setuptools writes build/ and d3s.egg-info/ beside the
sources, and those stay out of the checkout.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOT_SOURCES = (".git", ".venv*", "runs", ".cache", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis")
PROBE = """
import doctest, importlib.metadata as md, json, d3s
files = sorted(str(f) for f in md.files("d3s") if ".dist-info" not in str(f) and "__pycache__" not in str(f))
tests = doctest.testmod(d3s)
print(json.dumps({"file": d3s.__file__, "requires": md.requires("d3s"), "files": files,
                  "attempted": tests.attempted, "failed": tests.failed}))
"""


def run(cmd, **kw):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=300, **kw)
    assert proc.returncode == 0, f"{cmd}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return proc.stdout


def test_pip_install_puts_d3s_alone_in_a_fresh_venv_and_its_doctests_pass(tmp_path):
    pytest.importorskip("setuptools", reason="the build backend pyproject.toml names (requirements/dev.txt)")
    source = tmp_path / "repo"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    venv = tmp_path / "venv"  # no pip and no packages of its own
    run([sys.executable, "-m", "venv", "--without-pip", venv])
    python = venv / "bin" / "python"
    site_packages = run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip()
    shared = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})  # this venv's: torch, pip
    with open(os.path.join(site_packages, "shared_venv.pth"), "w") as f:  # read after the fresh venv's own packages
        f.write("".join(f"import site; site.addsitedir({path!r})\n" for path in shared))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    run(
        [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index", source],
        cwd=tmp_path,
        env=env,
    )

    elsewhere = tmp_path / "elsewhere"  # outside the repository: the import finds the installed module or nothing
    elsewhere.mkdir()
    found = json.loads(run([python, "-c", PROBE], cwd=elsewhere, env=env).strip().splitlines()[-1])
    assert found["file"] == os.path.join(site_packages, "d3s.py"), found["file"]
    assert pathlib.Path(found["file"]).read_bytes() == (ROOT / "d3s.py").read_bytes()
    assert found["requires"] == ["torch>=2.4"]  # torch its one dependency: 2.13.0, the repository's pin, meets it
    assert found["files"] == ["d3s.py"]  # no support/, no rung, no tests: they stay scripts in the repository
    assert found["attempted"] > 10 and found["failed"] == 0, found
