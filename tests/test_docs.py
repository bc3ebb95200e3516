"""The Python examples in the README and docs/ run as written; their links and command options exist."""
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


_LINKED = [*DOCS, ROOT / "configs" / "paper" / "README.md", *sorted((ROOT / "results").rglob("README.md"))]


def test_relative_links_name_existing_files():
    missing = []
    for path in _LINKED:
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", path.read_text()):
            if "://" not in target and not (path.parent / target).exists():
                missing.append(f"{path.relative_to(ROOT)}: {target}")
    assert not missing, missing


def _commands_with_options():
    """Each ``falcon-fwa COMMAND --option ...`` of the docs, continuation lines joined."""
    for path in DOCS:
        text = re.sub(r"\\\n\s*", " ", path.read_text())
        for line in text.splitlines():
            for match in re.finditer(r"falcon-fwa ([a-z][a-z-]*)([^`|]*)", line):
                yield path.name, match.group(1), re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", match.group(2))


def test_documented_command_options_exist():
    import argparse
    import importlib

    from falcon_fwa.cli import COMMANDS

    known = {}
    bad = []
    for doc, name, flags in _commands_with_options():
        assert name in COMMANDS, f"{doc}: no command {name!r}"
        if name not in known:
            parser = argparse.ArgumentParser()
            importlib.import_module(COMMANDS[name][0]).add_arguments(parser)
            known[name] = {s for action in parser._actions for s in action.option_strings}
        bad += [f"{doc}: falcon-fwa {name} {flag}" for flag in flags if flag not in known[name]]
    assert not bad, bad
