"""A fork server for tests/test_full_cli.py: runs `train_full.py ARGV` many times without paying
Python's and torch's start-up each time.

    python tests/full_cli_worker.py        # then one JSON list (an argv) per line on stdin

It imports train_full once, and for each line forks a child that runs train_full.entry(argv), the
function `python train_full.py ARGV` runs, with its stdout and stderr going to files. The child
ends as that command would (entry's os._exit on an error; exit 0 after a normal return), so the
exit status and stderr are the real ones. One JSON line per run comes back: {"code", "stderr",
"stdout"}. The parent never runs torch itself, so each child starts from a clean, unthreaded
state. A child that runs longer than D3S_CLI_TIMEOUT seconds (default 240) is killed (SIGALRM).
"""

import json
import os
import signal
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_full  # noqa: E402

TIMEOUT = int(os.environ.get("D3S_CLI_TIMEOUT", "240"))


def run(argv):
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: train_full.py ARGV
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            signal.alarm(TIMEOUT)
            try:
                train_full.entry(argv)
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os._exit(0)
        _, status = os.waitpid(pid, 0)
        out.seek(0), err.seek(0)
        return {
            "code": os.waitstatus_to_exitcode(status),
            "stdout": out.read().decode(errors="replace")[-3000:],
            "stderr": err.read().decode(errors="replace"),
        }


if __name__ == "__main__":
    for line in sys.stdin:
        print(json.dumps(run(json.loads(line))), flush=True)
