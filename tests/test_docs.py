"""The Python examples in the README and docs/ run as written, and print what the ``text`` block after one
shows; their links and command options exist."""
import contextlib
import io
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks():
    """Each ``python`` block, with the ``text`` block that follows it (after blank lines only) or ``None``."""
    for path in DOCS:
        found = re.findall(r"```python\n(.*?)```(?:\n\s*\n```text\n(.*?)```)?", path.read_text(), flags=re.S)
        for i, (block, shown) in enumerate(found):
            yield pytest.param(block, shown or None, id=f"{path.name}-{i}")


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def same_output(got: str, shown: str) -> bool:
    """``got`` prints what ``shown`` shows: the same text around the numbers (whitespace aside, which a
    tensor's printout pads by its widest entry), and each number within 1e-4 + 1e-3 of its relative size
    (the last printed digit may differ between CPUs)."""
    def text(s):
        return re.sub(r"\s+", "", _NUMBER.sub("#", s))
    a, b = _NUMBER.findall(got), _NUMBER.findall(shown)
    return text(got) == text(shown) and len(a) == len(b) and all(
        abs(float(x) - float(y)) <= 1e-4 + 1e-3 * abs(float(y)) for x, y in zip(a, b))


@pytest.mark.parametrize("code, shown", list(_blocks()))
def test_doc_example_runs(code, shown):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "<doc>", "exec"), {"__name__": "__doc_example__"})
    if shown is not None:
        assert same_output(out.getvalue(), shown), f"printed:\n{out.getvalue()}\nthe doc shows:\n{shown}"


def test_shown_output_is_compared():
    shown = "1 tensor([2.4141, 0.0075])\n[[150, 0]] tensor([0.0010])\n"
    assert same_output("1 tensor([ 2.4141,  0.0076])\n[[150, 0]] tensor([0.0010])\n", shown)
    assert not same_output("1 tensor([2.5141, 0.0075])\n[[150, 0]] tensor([0.0010])\n", shown)  # a number
    assert not same_output("1A tensor([2.4141, 0.0075])\n[[150, 0]] tensor([0.0010])\n", shown)  # the text
    assert not same_output("1 tensor([2.4141, 0.0075])\n[[150, 0], [150, 1]] tensor([0.0010])\n", shown)
    blocks = {p.id: p.values for p in _blocks()}
    assert blocks["README.md-1"][1].startswith("1 tensor(")  # the README's falcon_trace example shows its output


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
