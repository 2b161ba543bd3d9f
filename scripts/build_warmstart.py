"""scripts/build_warmstart.py [FOLDER]: build train_small.py's default warm start afresh into FOLDER/warmstart-<hash>/
(default weights/, the one the repository ships and every default run loads), with its build.json; support/warmstart.py says
why and tests/test_warmstart_shipped.py checks it."""

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import train_small  # noqa: E402
from support import warmstart  # noqa: E402

if __name__ == "__main__":
    if sys.argv[1:2] in (["-h"], ["--help"]):
        sys.exit(print(__doc__))
    warmstart.build_shipped(train_small.parse_args(["--cache-dir", (sys.argv[1:] or [warmstart.SHIPPED_DIR])[0]]))
