"""The docs hold together and the repository stands alone.

- Every relative link of README.md, docs/*.md and data/README.md points at a file or folder that
  exists, so moving a section cannot leave a dead link behind.
- No tracked file refers to the folder outside the repository where the data, the design notes
  and the papers used to live: the data are in data/, the specification is docs/algorithm.md.
- No page (README.md, docs/, lesson/, d3s.py) says "the paper does not state X" in any wording, within a sentence
  broken over lines too ("the paper's Table 3 ... without saying whether", issue 56, E1): the sources at hand are
  not the paper's text, so a page says "no source at hand states X" (issue 45).
- lesson/checks.py and lesson/answers.py point at the lesson's sections as 'section N, "Title"', and
  each is a real '## N. Title' heading of lesson/lesson.py.
- README.md carries no date, and each of its figures (a decimal, not a version) is printed on a
  page its paragraph links to, where the figure's date, machine and command live; a handful at most.
Each check's helper is shown to fail on a small broken input first.
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


# ---------------------------------------------------------------------------------------------
# What the pages say of the paper: no source at hand is its text (docs/algorithm.md, introduction), so a page says
# "no source at hand states X", never "the paper does not state X" (issue 45, M2).
# ---------------------------------------------------------------------------------------------
# Within one sentence, across line breaks: "the paper" (or "the paper's X") and then what it does not state, in any
# wording that E1 of issue 56 used ("The paper's Table 3 reports ... without saying whether ...").
PAPER_SILENCE = re.compile(
    r"\bthe (?:D3S )?paper(?:'s)?\b(?:(?!\.\s)[^;]){0,200}?"
    r"\b(?:(?:does not|doesn't|did not|didn't|never) (?:state|say|give|specify|report)s?|is silent"
    r"|without (?:saying|stating|giving|specifying))\b",
    re.I,
)


def silence_claims(text):
    """The lines of `text` (1-based) where a sentence says what the paper does not state. Lines are joined (comment
    markers dropped) so that a sentence broken over lines is read whole; a hit is reported at the line it starts on."""
    lines = [re.sub(r"^\s*#+\s?", "", line).strip() for line in text.splitlines()]
    starts, joined = [], ""
    for line in lines:
        starts.append(len(joined))
        joined += line + " "
    return sorted(
        {max(i for i, at in enumerate(starts) if at <= m.start()) + 1 for m in PAPER_SILENCE.finditer(joined)}
    )


def test_the_silence_pattern_finds_the_claim():
    text = (
        "G = 32 is inferred.\nThe paper does not state G;\nthe paper's doesn't state it\nThe D3S paper doesn't say.\n"
        "The paper's Table 3 reports a speed-up\nwithout saying whether in steps.\n# the paper\n# never gives G.\n"
    )
    assert silence_claims(text) == [2, 3, 4, 5, 7]
    assert silence_claims("No source at hand states the paper's G; the paper states N.") == []
    assert silence_claims("The notes do not say whether in steps; the paper's abstract gives a reason.") == []
    assert silence_claims("Notes on the paper quote Table 3. The notes do not say whether in steps.") == []


def test_no_page_says_what_the_paper_does_not_state():
    files = ["README.md", "d3s.py"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
    files += sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "lesson").iterdir() if p.suffix in (".py", ".md", ".ipynb")
    )
    assert "lesson/lesson.py" in files and "docs/algorithm.md" in files and "docs/results.md" in files
    found = {name: silence_claims((ROOT / name).read_text(encoding="utf-8")) for name in files}
    found = {name: lines for name, lines in found.items() if lines}
    assert not found, f"say 'no source at hand states X' (the sources are not the paper's text): {found}"


# ---------------------------------------------------------------------------------------------
# The lesson's checkers and answers point at its sections by number and title, and both are the lesson's own.
# ---------------------------------------------------------------------------------------------
def lesson_sections(source):
    """{number: title} of the '## N. Title' headings of the markdown cells of a jupytext percent source."""
    sections, markdown = {}, False
    for line in source.splitlines():
        if line.startswith("# %%"):
            markdown = "[markdown]" in line
        elif markdown:
            heading = re.match(r"^# ## (\d+)\. (.+?)\s*$", line)
            if heading:
                sections[int(heading.group(1))] = heading.group(2)
    return sections


def section_reference_problems(text, sections):
    """Every 'section N' of `text` must read 'section N, "Title"' with the lesson's title of section N (a Python
    string's escaped quotes read as the quotes they are)."""
    problems = []
    text = text.replace("\\'", "'").replace('\\"', '"')
    for ref in re.finditer(r'section (\d+)(?:, "(.*?)")?', text):
        number, title = int(ref.group(1)), ref.group(2)
        if number not in sections:
            problems.append(f"{ref.group(0)!r}: the lesson has no section {number}")
        elif title != sections[number]:
            problems.append(f"{ref.group(0)!r}: section {number} is {sections[number]!r}")
    return problems


def test_the_section_reference_check_fails_on_a_wrong_reference():
    source = "# %% [markdown]\n# ## 7. Stability (`d3s-i`)\n#\n# %%\nx = 1  # ## 9. code\n# %% [markdown]\n# ## 8. Exercises\n"
    sections = lesson_sections(source)
    assert sections == {7: "Stability (`d3s-i`)", 8: "Exercises"}
    assert section_reference_problems('the exercises (lesson.ipynb, section 8, "Exercises")', sections) == []
    assert section_reference_problems("""'... section 7, "Stability (`d3s-i`)", ...'""", sections) == []
    assert section_reference_problems("""'section 8, "Exer\\'cises"'""", {8: "Exer'cises"}) == []
    assert len(section_reference_problems("the exercises (lesson.ipynb, section 7)", sections)) == 1
    assert len(section_reference_problems('section 7, "Exercises"', sections)) == 1
    assert len(section_reference_problems('section 9, "Exercises"', sections)) == 1


def test_the_checkers_and_answers_name_the_lessons_real_sections():
    sections = lesson_sections((ROOT / "lesson/lesson.py").read_text(encoding="utf-8"))
    assert "Exercises" in sections.values() and len(sections) >= 8
    problems = {}
    for name in ("lesson/checks.py", "lesson/answers.py"):
        text = (ROOT / name).read_text(encoding="utf-8")
        assert "section" in text, f"{name} names no section of the lesson"
        problems[name] = section_reference_problems(text, sections)
    assert not any(problems.values()), problems


# ---------------------------------------------------------------------------------------------
# README reads as the method: a handful of headline figures, each on a page its paragraph links to, where the
# figure's date, machine and command live; no date in the README itself (issue 45, item 4).
# ---------------------------------------------------------------------------------------------
DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# A measured figure: a decimal (0.081, +15.3, 23.2, 0.37x), not a version (2.13.0, Python 3.11) or an arXiv id.
FIGURE = re.compile(r"(?<![\w.+-])[-+]?(\d+\.\d+)(?![.\d])")
NOT_A_FIGURE = re.compile(r"(?:Python|TRL|torch|vllm|arXiv)\s*$")
HANDFUL = 15  # the README's distinct figures, intervals counted: the headline findings, no more


def prose(text):
    """Markdown without its code blocks, inline code and link targets: what a reader reads as text."""
    return re.sub(r"\]\([^)]*\)", "]", CODE.sub("", FENCE.sub("", text)))


def readme_figures(paragraph):
    text = prose(paragraph)
    return [m.group(1) for m in FIGURE.finditer(text) if not NOT_A_FIGURE.search(text[: m.start()])]


def untraced_figures(readme, read_page):
    """The figures of `readme` not printed on any page that their paragraph links to: [(figure, paragraph start)].
    read_page(path) -> the linked page's text (path relative to the repository, no anchor)."""
    untraced = []
    for paragraph in FENCE.sub("", readme).split("\n\n"):
        figures = readme_figures(paragraph)
        pages = [t.split("#")[0] for t in links(paragraph) if t.split("#")[0].endswith(".md") and ":" not in t]
        texts = [read_page(page) for page in pages]
        untraced += [(f, paragraph.strip()[:60]) for f in figures if not any(f in text for text in texts)]
    return untraced


def test_the_figure_check_fails_on_an_untraced_figure():
    pages = {"docs/a.md": "final reward +0.081 [+0.039, +0.123], 2026-11-24"}.get
    traced = "D3S ends +0.081 [+0.039, +0.123] ([run](docs/a.md#1-x)); torch 2.13.0, Python 3.11, arXiv 2509.22115."
    assert readme_figures(traced) == ["0.081", "0.039", "0.123"]
    assert untraced_figures(traced, pages) == []
    assert untraced_figures("D3S ends +0.085 ([run](docs/a.md)).", pages) == [
        ("0.085", "D3S ends +0.085 ([run](docs/a.md)).")
    ]
    assert [f for f, _ in untraced_figures("D3S ends +0.081 on the 2-core machine.", pages)] == ["0.081"]
    assert DATE.search(prose("run on 2026-11-24 ([run](docs/a.md))")) and not DATE.search(
        prose("[run](docs/a-2026-11-24.md)")
    )


def test_every_figure_of_the_readme_is_on_a_page_its_paragraph_links_to():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    untraced = untraced_figures(readme, lambda page: (ROOT / page).read_text(encoding="utf-8"))
    assert not untraced, f"link each figure to the page that made it (its date, machine and command): {untraced}"
    figures = {f for paragraph in FENCE.sub("", readme).split("\n\n") for f in readme_figures(paragraph)}
    assert 0 < len(figures) <= HANDFUL, (
        f"{len(figures)} figures in the README: keep the headline ones {sorted(figures)}"
    )


def test_the_readme_carries_no_dates():
    dated = [line for line in prose((ROOT / "README.md").read_text(encoding="utf-8")).splitlines() if DATE.search(line)]
    assert not dated, f"a date belongs on the page that made the figure (docs/results.md or its own): {dated}"
