"""Put the repository root on sys.path so the tests can `import d3s` however pytest is run; the `figures` marker;
the fixtures that several test files use."""

import pathlib
import subprocess
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "figures: compares what a run prints or writes with a figure kept in the repository (a page, a golden file, "
        "a doctest, a verdict); .ci/run runs these a second time on another float path (docs/tests.md, Figures)",
    )


@pytest.fixture
def small_disk(tmp_path):
    """A 64 MiB tmpfs (mounting needs root, as in CI; skipped where it is refused), and resize(bytes) to change its
    size: a write there meets a real ENOSPC once it is full."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("mounting a tmpfs needs root")
    yield disk, lambda size: subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)
    subprocess.run(["umount", str(disk)], capture_output=True)
