"""The docs: the site (mkdocs.yml, docs/) builds with `mkdocs build --strict`, so a broken link, a
missing anchor or a page left out of the nav fails here; README is a landing page whose links
land; and no page leans on what a fresh clone does not have (files beside the repository, issue
numbers from a tracker the reader cannot see)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
# `../shared/DESIGN.md`, `DESIGN.md`, "issue 11", "issue #12", "issues 4 and 9"
OUTSIDE = re.compile(r"\.\./shared|\bDESIGN\.md\b|(?i:\bissues?\s*#?\s*\d+)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_docs_site_builds_strictly(tmp_path: Path) -> None:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "WARNING" not in result.stderr, result.stderr
    assert (tmp_path / "site" / "configuration" / "settings" / "index.html").is_file()


def test_the_readme_is_a_landing_page_of_at_most_150_lines() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 150, f"README.md has {len(lines)} lines; move detail into a docs/ page"
    text = "\n".join(lines)
    for must in ("make run", "make test", "curl -s http://127.0.0.1:8080/v1/chat/completions",
                 "http://127.0.0.1:9003/", "docs/benchmarks.md"):
        assert must in text, must


def test_every_relative_link_in_the_readme_lands_on_a_file_in_the_repository() -> None:
    for target in LINK.findall(README.read_text()):
        if "://" in target or target.startswith("#"):
            continue
        path = (ROOT / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT), f"README links outside the repository: {target}"
        assert path.exists(), f"README links to a missing file: {target}"


def test_no_page_refers_to_files_outside_the_repository_or_to_issue_numbers() -> None:
    found = [f"{page.relative_to(ROOT)}:{n}: {line.strip()}"
             for page in PAGES for n, line in enumerate(page.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not found, "\n".join(found)
