"""The docs hold together and the repository stands alone.

- Every relative link of README.md, docs/*.md and data/README.md points at a file or folder that
  exists, so moving a section cannot leave a dead link behind.
- No tracked file refers to the folder outside the repository where the data, the design notes
  and the papers used to live: the data are in data/, the specification is docs/algorithm.md.
"""

import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def tracked():
    result = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True)
    return [name for name in result.stdout.decode().split("\0") if name]


FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)  # fenced code blocks: no links inside
CODE = re.compile(r"`[^`\n]*`")  # inline code: the text of [`docs/x.md`](docs/x.md) keeps its link
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")  # [text](target "title"), ![alt](target)
REFERENCE = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)  # [label]: target


def links(text):
    text = CODE.sub("", FENCE.sub("", text))
    return LINK.findall(text) + REFERENCE.findall(text)


def test_every_relative_link_in_the_markdown_points_at_a_file():
    pages = ["README.md", "data/README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
    assert "docs/algorithm.md" in pages and "docs/metrics.md" in pages
    dead, checked = [], 0
    for page in pages:
        for target in links((ROOT / page).read_text(encoding="utf-8")):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):  # https:, mailto:, an anchor
                continue
            path = target.split("#")[0].split("?")[0]
            checked += 1
            if not (ROOT / page).parent.joinpath(path).resolve().exists():
                dead.append(f"{page}: {target}")
    assert not dead, "dead links:\n" + "\n".join(dead)
    assert checked > 30  # the parser finds the links (README.md alone has more)


def test_the_link_parser():
    text = '[`docs/a.md`](docs/a.md) ![fig](b.png "t") `[no](c.md)`\n```\n[no](d.md)\n```\n[r]: e.md\n[web](https://x)'
    assert links(text) == ["docs/a.md", "b.png", "https://x", "e.md"]


# The old home outside the repository, spelled in pieces so that this file does not mention it.
OUTSIDE = re.compile(
    r"\.\./" + "shared" + r"|\b" + "shared" + r"/(?:data|design|paper)\b"
    r"|[\"']" + "shared" + r"[\"']\s*,\s*[\"'](?:data|design|paper)[\"']"
)
# Files that still mention it, each fixed by its owner: remove an entry with the fix (the test
# below fails once an entry is no longer needed).
NOT_YET = set()


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git checkout (git ls-files)")
def test_no_tracked_file_refers_to_the_folder_outside_the_repo():
    found = {}
    for name in tracked():
        path = ROOT / name
        if not path.is_file():  # a tracked file deleted in the working tree
            continue
        text = path.read_bytes().decode("utf-8", errors="replace")
        lines = [i + 1 for i, line in enumerate(text.splitlines()) if OUTSIDE.search(line)]
        if lines:
            found[name] = lines
    unexpected = {name: lines for name, lines in found.items() if name not in NOT_YET}
    assert not unexpected, f"files that refer outside the repo (use data/ or docs/algorithm.md): {unexpected}"
    assert not NOT_YET - set(found), f"{sorted(NOT_YET - set(found))} no longer refer outside: drop them from NOT_YET"


def test_the_outside_pattern():
    for text in (
        "../" + "shared" + "/data/x.jsonl",
        "see ../" + "shared",
        "`" + "shared" + "/design/ALGORITHM.md`",
        'os.path.join(ROOT, "' + "shared" + '", "data")',
    ):
        assert OUTSIDE.search(text), text
    for text in ("shared with other jobs", "the shared weight", "a shared 2-core machine", "/mnt/nfs/runs/full"):
        assert not OUTSIDE.search(text), text
