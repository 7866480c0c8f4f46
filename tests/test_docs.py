"""The docs render: every relative link resolves, and the API reference is current."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)]*)?\)")


def test_relative_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
             ROOT / "benchmarks" / "RESULTS.md"]
    broken = []
    for page in pages:
        for target, _ in LINK.findall(page.read_text()):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_api_reference_is_current():
    result = subprocess.run([sys.executable, str(ROOT / "docs" / "gen_api.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


USER_PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# The benchmark record is read by users too (the README links it).
READ_BY_USERS = [*USER_PAGES, ROOT / "benchmarks" / "RESULTS.md"]
# Words for what only the people who build fastfeed know: issue numbers ("issue 42", "issues
# 24 and 29", "#31"), the issue a figure came from ("the issue measured", "the ring issue"),
# reviews, working sessions, which machine was at hand or lent, who else shared it, which
# branch. A user reads what was measured, on what hardware, on which date, with which command.
INTERNAL = re.compile(r"\bissues? #?\d+|(?<![\w&`])#\d+\b|\bissue's\b|"
                      r"\b(the|this|that)( [\w-]+)? issue\b|\breview(er|ed|s)?\b|\blent\b|"
                      r"\bsessions?\b|\bengineers?\b|\bthis branch\b|previous context|"
                      r"development machine|this kind of machine|\bhere;",
                      re.IGNORECASE)


def _hits(pattern: re.Pattern[str], pages: list[Path]) -> list[str]:
    return [f"{page.relative_to(ROOT)}:{number}: {line.strip()}"
            for page in pages for number, line in enumerate(page.read_text().splitlines(), 1)
            if pattern.search(line)]


def test_user_docs_name_no_internal_references():
    assert not _hits(INTERNAL, READ_BY_USERS)


def test_install_lines_work_from_a_clone():
    # fastfeed is not on the package index: `pip install 'fastfeed[extra]'` fails for a user.
    lines = _hits(re.compile(r"pip install[^`\n]*\bfastfeed\["),
                  [*USER_PAGES, *sorted((ROOT / "examples").glob("*.py"))])
    assert not lines


def test_paths_the_docs_cite_exist():
    cited = re.compile(r"`((?:tests|benchmarks|examples|fastfeed|docs|csrc)/[\w./-]*\w/?)`")
    missing = [f"{page.relative_to(ROOT)}: {path}" for page in USER_PAGES
               for path in cited.findall(page.read_text()) if not (ROOT / path).exists()]
    assert not missing
