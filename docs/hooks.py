"""MkDocs hooks (mkdocs.yml: ``hooks``): the generated reference pages.

A page holds a marker line ``<!-- generated: NAME -->``; while the site builds, the marker is replaced by the
Markdown that docs/reference_gen.py writes from the code (``config-keys``: every config key from
fedhpro.config's option metadata; ``cli``: every command's ``--help``). An unknown marker name fails the build.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

MARKER = re.compile(r"^<!-- generated: ([a-z-]+) -->$", re.MULTILINE)


def _generator() -> ModuleType:
    path = Path(__file__).with_name("reference_gen.py")
    spec = importlib.util.spec_from_file_location("fedhpro_docs_reference_gen", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if "<!-- generated:" not in markdown:
        return markdown
    generator = _generator()
    makers = {"config-keys": generator.config_keys_markdown, "cli": generator.cli_markdown}

    def generated(match: re.Match[str]) -> str:
        name = match.group(1)
        if name not in makers:
            raise ValueError(f"{page.file.src_uri}: unknown generated section {name!r}; known: {sorted(makers)}")
        return makers[name]()

    return MARKER.sub(generated, markdown)
