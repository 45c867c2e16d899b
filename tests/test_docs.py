"""The docs cannot lie: the site builds in strict mode (a broken link, anchor or missing page
fails), the reference pages are those the code generates now, the README's links land on pages
and headings that exist, and its typical config is one the watcher accepts. The commands the
docs mark as runnable are run against the demo's folder in tests/test_demo.py."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from .conftest import REPO

DOCS = REPO / "docs"
README = REPO / "README.md"
RUNNABLE = "<!-- runnable -->"


def test_the_reference_pages_are_what_the_code_generates() -> None:
    r = subprocess.run(
        [sys.executable, str(REPO / "tools" / "reference.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr


def test_a_config_key_added_to_the_code_makes_the_reference_stale(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "tools"))
    try:
        import reference
    finally:
        sys.path.remove(str(REPO / "tools"))
    from ckpt_watcher.config import PolicyConfig

    page = reference.config_page()
    assert "| `journal_max_gb` |" in page and "| `order` |" in page
    field = PolicyConfig.model_fields["order"]
    before = field.description
    field.description = "A meaning somebody changed in config.py."
    try:
        assert reference.config_page() != page
        assert "A meaning somebody changed in config.py." in reference.config_page()
    finally:
        field.description = before


@pytest.mark.skipif(shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None,
                    reason="mkdocs is in the dev extra")  # fmt: skip
def test_the_site_builds_in_strict_mode(tmp_path: Path) -> None:
    r = subprocess.run(
        [str(Path(sys.executable).parent / "mkdocs"), "build", "--strict", "-d", str(tmp_path)],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    for page in ("", "getting-started", "concepts", "reference/config", "reference/cli"):
        assert (tmp_path / page / "index.html").exists(), page
    assert (tmp_path / "reference" / "config" / "index.html").read_text().count("<tr>") > 100


def _slugs(page: Path) -> set[str]:
    from markdown.extensions.toc import slugify

    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {
        slugify(re.sub(r"[`*]", "", m), "-") for m in re.findall(r"^#+ (.+)$", text, flags=re.M)
    }


def test_the_readme_links_land_on_pages_and_headings_that_exist() -> None:
    text = README.read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 200
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert len(links) >= 15
    for link in links:
        if link.startswith("http"):
            continue
        path, _, anchor = link.partition("#")
        target = REPO / path
        assert target.exists(), link
        if anchor:
            assert anchor in _slugs(target), link


def test_the_readmes_typical_config_is_one_the_watcher_accepts() -> None:
    from ckpt_watcher.config import WatcherConfig

    text = README.read_text(encoding="utf-8")
    (block,) = re.findall(r"## A typical run's config\n\n```yaml\n(.*?)```", text, flags=re.S)
    assert len(block.splitlines()) <= 25
    cfg = WatcherConfig.model_validate(yaml.safe_load(block))
    assert [s.kind for s in cfg.sources] == ["local", "s3"]
    assert cfg.devices.gpus == [6, 7] and cfg.eval.tensor_parallel_size == 1


def runnable_blocks() -> list[tuple[str, str, list[str]]]:
    """(page, command, the output lines shown right after it, if any) for each block a page
    marks `<!-- runnable -->`."""
    out = []
    for page in sorted([README, *DOCS.rglob("*.md")]):
        text = page.read_text(encoding="utf-8")
        pattern = re.escape(RUNNABLE) + r"\n```bash\n(.*?)```\n(?:\n```\n(.*?)```)?"
        for m in re.finditer(pattern, text, flags=re.S):
            shown = [ln for ln in (m.group(2) or "").splitlines() if ln.strip()]
            out.append((str(page.relative_to(REPO)), m.group(1).strip(), shown))
    return out


def test_the_docs_mark_commands_to_run() -> None:
    blocks = runnable_blocks()
    assert len(blocks) >= 5
    assert all("watcher-demo/watcher.yaml" in cmd for _, cmd, _ in blocks)
