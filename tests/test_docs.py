"""The Python examples in the README and docs/ run as written."""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks():
    for path in DOCS:
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)):
            yield pytest.param(block, id=f"{path.name}-{i}")


@pytest.mark.parametrize("code", list(_blocks()))
def test_doc_example_runs(code):
    exec(compile(code, "<doc>", "exec"), {"__name__": "__doc_example__"})
