"""The project's design note is in the repo, and what the code cites of it is there."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTE = ROOT / "docs" / "design.md"


def sources():
    for folder in ("fastfeed", "tests", "benchmarks"):
        yield from (ROOT / folder).rglob("*.py")


def test_every_invariant_cited_is_in_the_design_note():
    numbered = set(re.findall(r"^(\d+)\. \*\*", NOTE.read_text(), re.MULTILINE))
    cited = {(path.relative_to(ROOT), number)
             for path in sources()
             for number in re.findall(r"invariant (\d+)", path.read_text())}
    assert cited, "no citation found: the pattern is stale"
    assert {c for c in cited if c[1] not in numbered} == set()


def test_every_doc_file_the_code_cites_exists():
    """A comment that sends the reader to a file of the repo sends them somewhere real."""
    cited = {(path.relative_to(ROOT), target)
             for path in sources()
             for target in re.findall(r"\b((?:docs|benchmarks|tests)/[\w/.-]+\.(?:md|py|sh))",
                                      path.read_text())}
    assert cited
    assert {c for c in cited if not (ROOT / c[1]).exists()} == set()


def test_no_citation_of_a_design_file_outside_the_repo():
    stale = [str(path.relative_to(ROOT)) for path in sources()
             if re.search(r"(?<![\w/])DESIGN\.md", path.read_text())]
    assert stale == []
