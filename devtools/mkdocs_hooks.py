"""MkDocs hooks (mkdocs.yml ``hooks:``): the reference pages are filled in at build time
from the code (``devtools/docs_reference.py``), so the manual cannot drift from it."""

from __future__ import annotations

from typing import Any

from devtools.docs_reference import render


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return render(markdown)
