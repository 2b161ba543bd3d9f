"""Put the repository root on sys.path so the tests can `import d3s` however pytest is run."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
