"""The project stands on its own: no citation of files outside it, no dead relative link.

Why: someone who clones the repository has only the repository. A README, a doc page, a
docstring or a comment that sends the reader to a planning file, to a sibling directory or to a
numbered ticket of some tracker sends them nowhere. What a maintainer needs lives in ``docs/``;
this test keeps it that way, and keeps every relative link of the README and of ``docs/*.md``
pointing at a file that exists inside the repository.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: What is scanned: the README, the docs, the package, the tests, the examples, the scripts and
#: the benchmark's prose (its raw outputs under bench/results are data, not prose).
SCANNED_DIRS = ("docs", "src", "tests", "examples", "scripts")
SCANNED_FILES = ("README.md",)
SCANNED_GLOBS = ("bench/*.md",)
TEXT_SUFFIXES = {".md", ".py", ".txt", ".toml", ".cfg", ".ini", ".json", ".yaml", ".yml", ".sh", ""}


def _forbidden() -> list[tuple[str, re.Pattern[str]]]:
    """The citations that point outside the repository.

    The patterns are assembled from pieces so that this file, which is scanned too, does not
    contain the very strings it looks for.
    """
    dot_md = r"\.md"
    return [
        ("a planning file outside the repository", re.compile(r"\b" + "DESIGN" + dot_md + r"\b")),
        ("a planning file outside the repository", re.compile(r"\b" + "REFERENCE" + dot_md + r"\b")),
        ("a sibling directory of the repository", re.compile(re.escape("..") + r"/" + "shared")),
        ("a design note that is not in the repository", re.compile("seed" + r"\s+(?:design\s+)?" + "note", re.I)),
        ("a ticket of a tracker the reader cannot see", re.compile(r"\b" + "issue" + r"s?\s*#?\s*\d+", re.I)),
    ]


def _tracked(paths: list[str]) -> list[Path] | None:
    """Tracked files under ``paths`` (git), or None when this is not a git checkout."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--", *paths],
            cwd=ROOT,
            capture_output=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    files = [ROOT / name for name in out.decode().split("\0") if name]
    return files or None


def _walked(paths: list[str]) -> list[Path]:
    """Every file under ``paths`` (an unpacked copy without git metadata), minus caches."""
    files: list[Path] = []
    for path in paths:
        for hit in sorted(ROOT.glob(path)):
            candidates = [hit] if hit.is_file() else sorted(p for p in hit.rglob("*") if p.is_file())
            files += [p for p in candidates if "__pycache__" not in p.parts and not p.name.endswith(".pyc")]
    return files


def scanned_files() -> list[Path]:
    paths = [*SCANNED_FILES, *SCANNED_DIRS, *SCANNED_GLOBS]
    files = _tracked(paths)
    if files is None:
        files = _walked(paths)
    return [f for f in files if f.is_file() and f.suffix in TEXT_SUFFIXES]


def find_citations(text: str) -> list[tuple[int, str, str]]:
    """(line number, what was found, why it is refused) for every outside citation in ``text``."""
    hits = []
    for number, line in enumerate(text.splitlines(), start=1):
        for why, pattern in _forbidden():
            for match in pattern.finditer(line):
                hits.append((number, match.group(0), why))
    return hits


def test_the_patterns_catch_what_they_are_for() -> None:
    """The scan is only evidence if it finds each kind of citation (and leaves ordinary prose)."""
    samples = [
        "see " + "DESIGN" + ".md section 2",
        "(" + "REFERENCE" + ".md sec. 3)",
        "`" + ".." + "/shared/notes`",
        "the " + "seed" + " note's bug 1",
        "the " + "seed design" + " note",
        "Benchmark results (" + "issue" + " 6)",
        "fixed in " + "Issue" + " #12",
    ]
    for sample in samples:
        assert find_citations(sample), f"not caught: {sample!r}"
    for fine in ("docs/design.md", "the seed of the noise", "an issue with 2 ranks", "README.md"):
        assert not find_citations(fine), f"caught by mistake: {fine!r}"


def _citations_in(files: list[Path]) -> list[str]:
    problems = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue  # not prose
        for number, found, why in find_citations(text):
            problems.append(f"{path.relative_to(ROOT)}:{number}: {found!r} ({why})")
    return problems


_ADVICE = (
    "these lines cite files or tickets outside the repository; say the thing itself, or link the page of "
    "docs/ that says it"
)


def test_the_documentation_cites_nothing_outside_the_repository() -> None:
    """README.md, docs/ and the benchmark's prose: what a reader opens first."""
    files = [f for f in scanned_files() if f.suffix == ".md"]
    assert any(f.name == "README.md" for f in files) and any(f.parent.name == "docs" for f in files), files[:5]
    problems = _citations_in(files)
    assert not problems, _ADVICE + ":\n  " + "\n  ".join(problems)


def test_no_file_cites_anything_outside_the_repository() -> None:
    files = scanned_files()
    assert any(f.name == "README.md" for f in files) and any(f.suffix == ".py" for f in files), files[:5]
    problems = _citations_in(files)
    assert not problems, _ADVICE + ":\n  " + "\n  ".join(problems)


_LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^\s*\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
_FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)


def relative_links(text: str) -> list[str]:
    """Link targets of a Markdown text that point into the repository (no URL, no pure anchor)."""
    text = _FENCE.sub("", text)  # links inside code blocks are code, not links
    targets = _LINK.findall(text) + _REFERENCE_LINK.findall(text)
    out = []
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue  # http:, https:, mailto:, ... or a link inside the same page
        out.append(target)
    return out


def _markdown_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_relative_links_point_at_files_in_the_repository() -> None:
    pages = _markdown_pages()
    assert len(pages) > 1
    broken = []
    checked = 0
    for page in pages:
        for target in relative_links(page.read_text(encoding="utf-8")):
            path = target.split("#", 1)[0]
            resolved = (page.parent / path).resolve()
            checked += 1
            if ROOT not in resolved.parents and resolved != ROOT:
                broken.append(f"{page.relative_to(ROOT)}: {target} leaves the repository")
            elif not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} does not exist")
    assert checked > 0, "no relative link found at all: the link pattern is broken"
    assert not broken, "broken relative links:\n  " + "\n  ".join(broken)


def test_the_readme_links_every_docs_page() -> None:
    """Every page of docs/ is reachable from the README (a page nobody links is a page nobody reads)."""
    readme = ROOT / "README.md"
    linked = {(readme.parent / t.split("#", 1)[0]).resolve() for t in relative_links(readme.read_text("utf-8"))}
    missing = [p.name for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("[a](docs/x.md) and [b](https://example.org) and [c](#anchor)", ["docs/x.md"]),
        ('[a](docs/x.md#part "title")', ["docs/x.md#part"]),
        ("```\n[not a link](nowhere.md)\n```\n[yes](here.md)", ["here.md"]),
        ("[ref]: ../elsewhere.md", ["../elsewhere.md"]),
    ],
)
def test_link_extraction(text: str, expected: list[str]) -> None:
    assert relative_links(text) == expected


#: A test cited in prose: ``file.py::test_name`` (optionally ``tests/`` first and a ``[param]`` after),
#: or ``::test_name`` for another test of the file cited last.
_CITED_TEST = re.compile(r"`((?:tests/)?(test_\w+\.py))?::(test_\w+)(?:\[[^`\]]*\])?")


def cited_tests(text: str) -> list[tuple[str, str]]:
    """(file, test) of every test ``text`` cites, resolving ``::name`` to the file cited before it."""
    found, current = [], None
    for match in _CITED_TEST.finditer(text):
        current = match.group(2) or current
        if current is not None:
            found.append((current, match.group(3)))
    return found


def test_every_test_the_docs_cite_exists() -> None:
    """A promise in docs/ (guarantees.md above all) names the test that proves it: that test must exist,
    so a refactor that renames or drops a test cannot leave a promise without its proof."""
    defined: dict[str, set[str]] = {}
    for path in (ROOT / "tests").glob("test_*.py"):
        defined[path.name] = set(re.findall(r"^(?:async )?def (test_\w+)", path.read_text(), flags=re.MULTILINE))
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for file, name in cited_tests(page.read_text()):
            if name not in defined.get(file, set()):
                missing.append(f"{page.relative_to(ROOT)}: {file}::{name}")
    assert not missing, "cited tests that do not exist:\n" + "\n".join(missing)


def test_cited_tests_resolve_a_bare_name_to_the_file_cited_before() -> None:
    text = "`test_a.py::test_one`; `::test_two[x]`, then `tests/test_b.py::test_three` and `::test_four`"
    assert cited_tests(text) == [
        ("test_a.py", "test_one"),
        ("test_a.py", "test_two"),
        ("test_b.py", "test_three"),
        ("test_b.py", "test_four"),
    ]


def test_the_readme_is_a_users_page() -> None:
    """At most 150 lines: what it does, the two commands, the quick starts, one measured table, links;
    the knobs and the full benchmark live in docs/."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail into docs/"
    assert lines[2] == "```bash" and lines[3].startswith("make demo") and lines[4].startswith("make test"), lines[:6]
