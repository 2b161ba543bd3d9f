"""Write lesson/lesson.ipynb from lesson/lesson.py (the source, jupytext's percent format), executed top to bottom,
with its outputs: what a code host shows without running it. Run it after editing the source (about a minute):

    .venv/bin/python lesson/build.py
    .venv/bin/python lesson/build.py --help      # what it does; it writes nothing
"""

import os
import sys
import time

import jupytext
import nbformat
from nbclient import NotebookClient

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
from support import cli  # noqa: E402  (the repository's one-line errors: an unknown flag is refused before any work)


def execute(source=os.path.join(HERE, "lesson.py"), timeout=1200):
    """The notebook of `source`, executed in the lesson's folder (an error in a cell raises); returns (nb, seconds)."""
    nb = jupytext.read(source)
    t0 = time.time()
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": HERE}}).execute()
    return nb, time.time() - t0


def normalise(nb):
    """Cell ids by position, no per-cell execution times, a cell's printed lines in one output (the kernel splits
    them at random): a rebuild changes only what the cells print."""
    for i, cell in enumerate(nb.cells):
        cell.id = f"cell-{i:02d}"
        cell.metadata.pop("execution", None)
        outputs = []
        for out in cell.get("outputs", []):
            if (
                outputs
                and out.output_type == "stream"
                and outputs[-1].output_type == "stream"
                and outputs[-1].name == out.name
            ):
                outputs[-1].text += out.text
            else:
                outputs.append(out)
        if cell.cell_type == "code":
            cell.outputs = outputs
    return nb


def main(argv=None):
    """No flags: execute lesson/lesson.py and write lesson/lesson.ipynb (--help says so and writes nothing)."""
    p = cli.Parser(
        prog="build.py",
        description="Execute lesson/lesson.py top to bottom and write lesson/lesson.ipynb "
        "with its outputs (about a minute). It takes no flags.",
    )
    p.parse_args(argv)
    nb, seconds = execute()
    normalise(nb)
    nbformat.write(nb, os.path.join(HERE, "lesson.ipynb"))
    print(f"lesson.ipynb written: executed in {seconds:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
