"""MkDocs hook: docstring examples (``>>>`` lines and their output) become code blocks,
and Sphinx roles (``:class:`Flow```) plain code.

ackflow's docstrings carry doctests that pytest runs (``--doctest-modules``). As
plain Markdown their output lines (``['scale', 'positive']``) would read as links;
this Markdown preprocessor fences each run of ``>>>``/``...`` lines and the output
after them (up to a blank line) as a ``pycon`` block, for the pages and for the API
reference that mkdocstrings renders from the docstrings.
"""

from __future__ import annotations

import re

from markdown import Extension, Markdown
from markdown.preprocessors import Preprocessor
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.plugins import event_priority

PROMPT = re.compile(r"^(\s*)>>> ")
FENCE = re.compile(r"^\s*(```|~~~)")
ROLE = re.compile(r":(?:class|func|meth|mod|attr|data|exc|obj):`~?([^`]+)`")


class _Fence(Preprocessor):
    def run(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        fenced = False
        i = 0
        while i < len(lines):
            line = lines[i]
            if FENCE.match(line):
                fenced = not fenced
            m = None if fenced else PROMPT.match(line)
            if m is None:
                out.append(line if fenced else ROLE.sub(r"`\1`", line))
                i += 1
                continue
            indent = m.group(1)
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
                i += 1
            out += ["", f"{indent}```pycon", *(indent + b for b in block), f"{indent}```", ""]
        return out


class DoctestBlocks(Extension):
    def extendMarkdown(self, md: Markdown) -> None:  # Markdown's own name
        md.preprocessors.register(_Fence(md), "ackflow_doctest_blocks", 40)


@event_priority(100)
def on_config(config: MkDocsConfig) -> MkDocsConfig:
    config.markdown_extensions.append(DoctestBlocks())  # type: ignore[arg-type]
    return config
