"""The documentation: the site builds in strict mode, and the README reaches every guide page in one click."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
GUIDE = ROOT / "docs" / "guide"


def _readme_links() -> list[str]:
    return re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", (ROOT / "README.md").read_text())


def test_the_site_builds_in_strict_mode(tmp_path):
    """A broken link, anchor, API reference or notebook page is an error in strict mode."""
    built = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
                           cwd=ROOT, capture_output=True, text=True, timeout=600,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert built.returncode == 0, built.stderr[-4000:]
    for page in ("guide/sharding", "api/torch-tpu", "notebooks/quickstart", "performance", "changelog"):
        assert (tmp_path / page / "index.html").is_file(), page
    api = (tmp_path / "api" / "torch-tpu" / "index.html").read_text()
    assert "hf_tpu.device_module.synchronize" in api and "hf_tpu.device_module.memory_allocated" in api


def test_the_readme_links_to_every_guide_page():
    linked = {(ROOT / link).resolve() for link in _readme_links() if not link.startswith("http")}
    missing = sorted(page.name for page in GUIDE.glob("*.md") if page.resolve() not in linked)
    assert not missing, f"README.md links to no {missing}"


def test_the_readme_links_resolve():
    broken = [link for link in _readme_links() if not link.startswith("http") and not (ROOT / link).exists()]
    assert not broken, broken


def test_the_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 260, f"README.md has {len(lines)} lines: move the details to docs/guide/"
    assert not re.search(r"\b[0-9a-f]{7,40}\b", "\n".join(lines)), "no commit hashes in the README"
