"""MkDocs hook: renders the marimo notebooks of ``notebooks/`` as pages of the site (``notebooks/<name>.md``).

Each notebook is exported by marimo itself (``marimo export md``: its prose and its code, in order); the page
says how to run it. The pages are generated at build time, never written into ``docs/``.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

from mkdocs.structure.files import File, Files

NOTEBOOKS = pathlib.Path(__file__).resolve().parents[2] / "notebooks"


def _page(notebook: pathlib.Path) -> str:
    exported = subprocess.run([sys.executable, "-m", "marimo", "export", "md", str(notebook)], check=True,
                              capture_output=True, text=True, timeout=120).stdout
    front_matter = re.match(r"\A---\n(.*?)\n---\n", exported, flags=re.DOTALL)
    title = re.search(r"^title: (.+)$", front_matter.group(1), flags=re.MULTILINE) if front_matter else None
    body = exported[front_matter.end():] if front_matter else exported
    body = body.replace("```python {.marimo}", "```python")
    run = (f"!!! note \"Run this notebook\"\n    `marimo edit notebooks/{notebook.name}` (interactive) or "
           f"`python notebooks/{notebook.name}` (as a script); CI runs it headless.\n\n")
    if body.lstrip().startswith("```"):  # a first code cell: the page's title comes before it
        body = f"# {title.group(1) if title else notebook.stem}\n\n" + body
    return run + body


def on_files(files: Files, config: dict) -> Files:
    for notebook in sorted(NOTEBOOKS.glob("*.py")):
        files.append(File.generated(config, f"notebooks/{notebook.stem}.md", content=_page(notebook)))
    return files
