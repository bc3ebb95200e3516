"""The shell commands of the README, docs/ and configs/ name commands, options, files and recipe fields
that exist. Nothing runs: every command of a ``bash``/``sh``/``shell``/``console`` block (and of the usage
comments of configs/**/*.yaml) that is the project's (``falcon-fwa COMMAND``, ``python -m falcon_fwa...``,
``torchrun ... -m falcon_fwa...``, ``python benchmarks/...``) goes through its own argparse parser, stopped
once it has parsed, with abbreviations off so that only full option names pass; the repository files it
names must exist, and its ``--set section.field=value`` overrides must build a valid recipe through
``falcon_fwa.train.config`` (a recipe that the block writes with ``cat > FILE <<'EOF'`` is read from the
block). In the text, a command written inline (`falcon-fwa throughput --compile`, `python
benchmarks/bench_kernels.py`) must name a program that exists and options of its own, and an option shown
alone (`--paired 15`) must be an option of a command of its document."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import pathlib
import re
import runpy
import shlex
import sys
from typing import Dict, List, NamedTuple, Optional, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "configs").rglob("*.md"))]
RECIPES = sorted((ROOT / "configs").rglob("*.yaml"))
SHELL_LANGS = ("bash", "sh", "shell", "console")
# top-level folders of the repository: a relative path into one of them, with a file suffix, is a file the
# repository must hold (outputs such as --results results/multigpu-paper name no suffix)
REPO_DIRS = ("benchmarks", "configs", "docs", "results", "scripts", "src", "tests")
FILE_SUFFIX = re.compile(r"\.(ya?ml|py|sh|json|jsonl|md|txt)$")
# commands of the shell or of other tools, which these docs use around the project's own
SHELL_TOOLS = {".", "source", "cd", "mkdir", "cat", "echo", "sleep", "kill", "wait", "pip", "head", "tail"}
OTHER_MODULES = {"venv", "pip", "pytest"}  # python -m MODULE of other packages
OPERATORS = {"&&", "||", ";", "|", "&", "(", ")"}
REDIRECTS = {">", ">>", "<", "<<", ">&", "&>", "<<<"}
ENV_ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")


class Command(NamedTuple):
    where: str  # FILE:LINE
    argv: List[str]
    files: Dict[str, str]  # paths the command's block writes with a here-document -> their text


# --------------------------------------------------------------------------------------------------
# extraction


def _shell_words(line: str) -> List[str]:
    lex = shlex.shlex(line, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    return list(lex)


def split_commands(text: str, where: Tuple[str, int], *, console: bool = False,
                   files: Optional[Dict[str, str]] = None) -> List[Command]:
    """The simple commands of shell ``text`` (whose first line is line ``where[1]`` of ``where[0]``):
    backslash-continued lines joined, comments dropped, ``$ `` prompts removed (in a ``console`` block
    only prompted lines are commands), split at ``&&``, ``;``, ``|`` and ``&``, redirections and
    environment-variable prefixes dropped. Here-document bodies are no commands: a ``cat > FILE <<'EOF'``
    body is kept as the text of FILE for the commands after it, and added to ``files`` when given (the
    files that the earlier blocks of the same document wrote, which its later blocks may read)."""
    name, first = where
    lines = text.split("\n")
    files = {} if files is None else files
    out: List[Command] = []
    i = 0
    while i < len(lines):
        start = i
        line = lines[i]
        if console:
            if not line.startswith("$ "):
                i += 1
                continue
            line = line[2:]
        while line.endswith("\\") and i + 1 < len(lines):
            i += 1
            line = line[:-1] + " " + lines[i].strip()
        i += 1
        words = _shell_words(line)
        if "<<" in words:  # the body runs to the line holding only the delimiter
            delimiter = words[words.index("<<") + 1]
            body = []
            while i < len(lines) and lines[i].strip() != delimiter:
                body.append(lines[i])
                i += 1
            assert i < len(lines), f"{name}:{first + start}: here-document without its closing {delimiter}"
            i += 1
        else:
            body = None
        segments: List[List[str]] = [[]]
        for word in words:
            if word in OPERATORS:
                segments.append([])
            else:
                segments[-1].append(word)
        for segment in segments:
            argv, it = [], iter(segment)
            for word in it:
                if word in REDIRECTS:  # the redirection and its target
                    target = next(it, None)
                    if word == ">" and body is not None and argv[:1] == ["cat"]:
                        files[target] = "\n".join(body) + "\n"
                else:
                    argv.append(word)
            while argv and ENV_ASSIGNMENT.match(argv[0]):
                argv.pop(0)
            if argv:
                out.append(Command(f"{name}:{first + start}", argv, dict(files)))
    return out


def _fenced_blocks(path: pathlib.Path):
    """``(language, first line number, text)`` of each fenced block of a Markdown file."""
    return _fenced_blocks_of(path.read_text())


def _fenced_blocks_of(text: str):
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^```(\w*)\s*$", lines[i])
        if m:
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            yield m.group(1), i + 2, "\n".join(lines[i + 1:j])
            i = j
        i += 1


def _recipe_comment_blocks(path: pathlib.Path):
    """``(first line number, text)`` of the commands in a recipe's comments: a comment line whose text
    starts with ``falcon-fwa`` or ``torchrun``, and the comment lines that continue it."""
    lines = path.read_text().split("\n")
    i = 0
    while i < len(lines):
        m = re.match(r"^#\s+((?:falcon-fwa|torchrun)\s.*)$", lines[i])
        if m:
            text, first = [m.group(1)], i + 1
            while text[-1].endswith("\\") and i + 1 < len(lines) and lines[i + 1].startswith("#"):
                i += 1
                text.append(lines[i][1:].strip())
            yield first, "\n".join(text)
        i += 1


def doc_commands() -> List[Command]:
    commands = []
    for path in DOCS:
        written: Dict[str, str] = {}  # a document is read top to bottom: a block reads what one before it wrote
        for lang, line, text in _fenced_blocks(path):
            if lang in SHELL_LANGS:
                rel = path.relative_to(ROOT).as_posix()
                commands += split_commands(text, (rel, line), console=lang == "console", files=written)
    for path in RECIPES:
        for line, text in _recipe_comment_blocks(path):
            commands += split_commands(text, (path.relative_to(ROOT).as_posix(), line))
    return commands


# --------------------------------------------------------------------------------------------------
# checking


class _Parsed(Exception):
    """Raised in place of returning from the first ``parse_args`` of a command: nothing after it runs."""

    def __init__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace):
        super().__init__(parser.prog)
        self.parser, self.namespace = parser, namespace


@contextlib.contextmanager
def _parse_only(*, parse: bool = True):
    """Every ``ArgumentParser`` parses without abbreviations (a shortened or misspelled option is an error,
    as its full name is what a reader copies), and the outermost parse raises ``_Parsed``; with ``parse``
    false it raises it at once, with no namespace (for the parser alone)."""
    real_args, real_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    depth = [0]

    def parse_known_args(self, args=None, namespace=None):
        self.allow_abbrev = False
        if not parse and depth[0] == 0:
            raise _Parsed(self, None)
        depth[0] += 1
        try:
            namespace, extras = real_known(self, args, namespace)
        finally:
            depth[0] -= 1
        if depth[0] == 0:
            raise _Parsed(self, namespace)  # a command that takes unknown arguments on purpose
        return namespace, extras

    def parse_args(self, args=None, namespace=None):
        self.allow_abbrev = False
        if not parse:
            raise _Parsed(self, None)
        depth[0] += 1
        try:
            namespace = real_args(self, args, namespace)
        finally:
            depth[0] -= 1
        raise _Parsed(self, namespace)

    argparse.ArgumentParser.parse_args = parse_args
    argparse.ArgumentParser.parse_known_args = parse_known_args
    try:
        yield
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = real_args, real_known


def _parsed(cmd: Command, call, *, parse: bool = True) -> _Parsed:
    """What ``call`` parsed; a parse error (argparse's message) or a call that returns without parsing
    fails the test, naming the doc line."""
    err = io.StringIO()
    saved = list(sys.argv), list(sys.path)
    try:
        with _parse_only(parse=parse), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            call()
    except _Parsed as parsed:
        return parsed
    except SystemExit:
        pytest.fail(f"{cmd.where}: {shlex.join(cmd.argv)}\n{err.getvalue().strip()}")
    finally:
        sys.argv[:], sys.path[:] = saved
    pytest.fail(f"{cmd.where}: {shlex.join(cmd.argv)}: returned without parsing its arguments")


def _repo_file(cmd: Command, path: str) -> None:
    assert (ROOT / path).is_file(), f"{cmd.where}: {path} is no file of the repository"


def _module_main(cmd: Command, name: str, args: List[str], parse: bool = True) -> _Parsed:
    """``python -m NAME ARGS`` of a project module: its ``main(argv)``, which ``if __name__ ==
    "__main__"`` runs."""
    assert name.split(".")[0] == "falcon_fwa", f"{cmd.where}: python -m {name}: no module of the project"
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError:
        pytest.fail(f"{cmd.where}: python -m {name}: no such module")
    assert callable(getattr(module, "main", None)) and '__name__ == "__main__"' in inspect.getsource(module), \
        f"{cmd.where}: python -m {name}: the module has no main() run as __main__"
    return _parsed(cmd, lambda: module.main(args), parse=parse)


def _script(cmd: Command, path: str, args: List[str], parse: bool = True) -> _Parsed:
    """``python SCRIPT ARGS``: the script run as ``__main__`` up to its argument parsing."""
    _repo_file(cmd, path)

    def call():
        sys.argv[:] = [path, *args]
        sys.path.insert(0, str((ROOT / path).parent))
        runpy.run_path(str(ROOT / path), run_name="__main__")
    return _parsed(cmd, call, parse=parse)


def parse_command(cmd: Command, *, parse: bool = True):
    """The ``_Parsed`` of a project command (``None`` for another tool's), after the checks of its
    program: the subcommand, module or script exists and takes these arguments. With ``parse`` false,
    its parser alone (the program's arguments are then not read)."""
    prog, args = cmd.argv[0], cmd.argv[1:]
    if prog == "falcon-fwa":
        from falcon_fwa import cli

        return _parsed(cmd, lambda: cli.main(args if parse else args[:1]), parse=parse)
    if prog in ("python", "python3"):
        if args[:1] == ["-m"]:
            if args[1] in OTHER_MODULES:
                return None
            return _module_main(cmd, args[1], args[2:], parse)
        assert args and args[0].endswith(".py"), f"{cmd.where}: python with neither -m nor a script"
        return _script(cmd, args[0], args[1:], parse)
    if prog == "torchrun":
        if not parse:  # torchrun ... -m MODULE: the module's parser
            assert "-m" in args, f"{cmd.where}: torchrun without -m MODULE"
            return _module_main(cmd, args[args.index("-m") + 1], [], parse)
        from torch.distributed.run import get_args_parser

        launch = _parsed(cmd, lambda: get_args_parser().parse_args(args)).namespace
        if launch.module:
            return _module_main(cmd, launch.training_script, launch.training_script_args)
        return _script(cmd, launch.training_script, launch.training_script_args)
    if prog in ("bash", "sh"):
        _repo_file(cmd, args[0])
        return None
    assert prog in SHELL_TOOLS, f"{cmd.where}: {prog!r} is neither a command of the project nor a known tool"
    return None


def _recipe_path(cmd: Command, path: str, tmp_path: pathlib.Path) -> str:
    """A recipe's path on this machine: a repository file, or a file the block writes itself."""
    if path in cmd.files:
        local = tmp_path / pathlib.Path(path).name
        local.write_text(cmd.files[path])
        return str(local)
    _repo_file(cmd, path)
    return str(ROOT / path)


def check_command(cmd: Command, tmp_path: pathlib.Path) -> None:
    parsed = parse_command(cmd)
    for word in cmd.argv[1:]:  # repository files named anywhere, --set values included
        path = word.split("=", 1)[-1]
        if path.split("/")[0] in REPO_DIRS and FILE_SUFFIX.search(path):
            _repo_file(cmd, path)
    if parsed is None:
        return
    ns = vars(parsed.namespace)
    recipes = [ns["config"]] if ns.get("config") else list(ns.get("configs") or [])
    for recipe in recipes:
        from falcon_fwa.train.config import apply_overrides, config_from_dict, read_recipe

        raw = read_recipe(_recipe_path(cmd, recipe, tmp_path))
        try:
            config_from_dict(apply_overrides(raw, ns.get("overrides") or []))
        except ValueError as err:
            pytest.fail(f"{cmd.where}: {recipe} with {ns.get('overrides')}: {err}")


# --------------------------------------------------------------------------------------------------
# commands and options named inline, in the text: `falcon-fwa COMMAND --option`, `--option value`

INLINE_PROGRAM = re.compile(r"^(?:falcon-fwa|torchrun|bash|python3?)(?:\s|$)(?!-m pytest)")


class Inline(NamedTuple):
    where: str
    words: List[str]  # placeholders kept: `[--opt]` as --opt, `...`, `{a,b}`, `<model>`


def _units(text: str):
    """Each paragraph and each table cell outside fenced blocks, as ``(offset -> line number, text)``:
    a paragraph's lines are joined with spaces, so that a span may run over a line break."""
    in_fence, para = False, []
    for n, line in enumerate(text.split("\n") + [""], 1):
        if line.startswith("```"):
            in_fence = not in_fence
            line = ""
        if in_fence or not line.strip() or line.lstrip().startswith("|"):
            if para:
                yield para
                para = []
            if not in_fence and line.lstrip().startswith("|"):
                yield [(n, cell) for cell in line.split("|")]
            continue
        para.append((n, line))


def inline_spans(text: str, name: str):
    """The inline commands of Markdown ``text`` (file ``name``), and its option spans (``--name ...``)
    as ``(FILE:LINE, --name)``."""
    commands, options = [], []
    for unit in _units(text):
        joined, starts = "", []
        for n, line in unit:
            starts.append((len(joined), n))
            joined += line + " "
        for m in re.finditer(r"`([^`]+)`", joined):
            span, where = m.group(1), f"{name}:{max(n for at, n in starts if at <= m.start())}"
            if INLINE_PROGRAM.match(span):
                commands.append(Inline(where, span.replace("[", " ").replace("]", " ").split()))
            elif span.startswith("--"):
                options.append((where, span.split()[0].split("=")[0]))
    return commands, options


def _expand(word: str) -> List[str]:
    """``a/{b,c}.yaml`` -> ``[a/b.yaml, a/c.yaml]`` (one brace group)."""
    m = re.search(r"\{([^{}]*,[^{}]*)\}", word)
    return [word[:m.start()] + alt + word[m.end():] for alt in m.group(1).split(",")] if m else [word]


def _option_names(cmd: Command) -> set:
    parsed = parse_command(cmd, parse=False)
    return set() if parsed is None else {s for a in parsed.parser._actions for s in a.option_strings}


def check_inline(span: Inline) -> set:
    """The program of an inline command exists, the options it shows are its own, the repository files
    it names exist, and a script's ``{a,b}`` stages are its stages; the option names of the program."""
    words = [w for w in span.words if w != "..."]
    cmd = Command(span.where, words, {})
    if len(words) == 1 or words[1:2] in (["--help"], ["-h"]):  # the program's name alone, or its help
        return set()
    names = _option_names(cmd)
    for word in words[1:]:
        if word.startswith("--"):
            assert word.split("=")[0] in names, f"{span.where}: {' '.join(span.words)}: no option {word}"
        for path in _expand(word):
            if path.split("/")[0] in REPO_DIRS and FILE_SUFFIX.search(path) and "<" not in path:
                _repo_file(cmd, path)
    if words[0] in ("bash", "sh"):
        script = (ROOT / words[1]).read_text()
        for word in words[2:]:
            for stage in _expand(word) if "{" in word else []:
                assert re.search(rf"^\s*{re.escape(stage)}\)", script, flags=re.M), \
                    f"{span.where}: {words[1]} has no stage {stage!r}"
    return names


def unknown_options(text: str, name: str, block_commands: List[Command]) -> List[str]:
    """Checks each inline command of Markdown ``text`` (:func:`check_inline`); the option spans shown
    alone (``--base 2``) that no command of the text has (its inline commands and ``block_commands``; any
    ``falcon-fwa`` command where it names none)."""
    commands, options = inline_spans(text, name)
    names = set()
    for span in commands:
        names |= check_inline(span)
    for cmd in block_commands:
        names |= _option_names(cmd)
    if not names:
        from falcon_fwa.cli import COMMANDS as SUBCOMMANDS

        for sub in SUBCOMMANDS:
            names |= _option_names(Command(name, ["falcon-fwa", sub], {}))
    return [f"{where}: {option}" for where, option in options if option not in names]


COMMANDS = doc_commands()


@pytest.mark.parametrize("cmd", [pytest.param(c, id=f"{c.where}-{c.argv[0]}") for c in COMMANDS])
def test_doc_command(cmd, tmp_path):
    check_command(cmd, tmp_path)


@pytest.mark.parametrize("path", [pytest.param(p, id=p.relative_to(ROOT).as_posix()) for p in DOCS])
def test_inline_commands_and_options(path):
    """The commands written inline check as :func:`check_inline`; an option shown alone is one of a
    command that its document names."""
    rel = path.relative_to(ROOT).as_posix()
    unknown = unknown_options(path.read_text(), rel, [c for c in COMMANDS if c.where.startswith(rel + ":")])
    assert not unknown, f"options that no command of {rel} has: {unknown}"


def test_every_shell_block_is_read():
    """Each shell block gives commands, and the project's own are all among them."""
    counted = {}
    for c in COMMANDS:
        counted[c.where.split(":")[0]] = counted.get(c.where.split(":")[0], 0) + 1
    for path in DOCS:
        rel = path.relative_to(ROOT).as_posix()
        text = "\n".join(t for lang, _, t in _fenced_blocks(path) if lang in SHELL_LANGS)
        mentions = len(re.findall(r"^\s*(?:[A-Z_]+=\S+\s+)*(?:falcon-fwa|torchrun|python3? -m falcon_fwa)\s",
                                  text, flags=re.M))
        project = [c for c in COMMANDS if c.where.startswith(rel + ":")
                   and (c.argv[0] in ("falcon-fwa", "torchrun") or c.argv[1:2] == ["-m"] and "falcon_fwa" in c.argv[2])]
        assert len(project) >= mentions, f"{rel}: {mentions} commands at line starts, {len(project)} read"


# --------------------------------------------------------------------------------------------------
# the checker itself refuses what a doc could get wrong


def _cmd(line: str, files=None) -> Command:
    (cmd,) = split_commands(line, ("test", 1))
    return cmd._replace(files=files or {})


def test_split_commands_joins_drops_and_keeps_heredocs():
    text = ("$ mkdir -p /tmp/x && cat > /tmp/x/r.yaml <<'EOF'\nmodel: {preset: tiny-falcon}\nEOF\n"
            "output line\n$ OMP_NUM_THREADS=1 falcon-fwa train --config /tmp/x/r.yaml \\\n"
            "    --set \"model.overrides={}\"  # a comment\n")
    cmds = split_commands(text, ("doc.md", 10), console=True)
    assert [c.argv for c in cmds] == [["mkdir", "-p", "/tmp/x"], ["cat"],
                                      ["falcon-fwa", "train", "--config", "/tmp/x/r.yaml", "--set",
                                       "model.overrides={}"]]
    assert [c.where for c in cmds] == ["doc.md:10", "doc.md:10", "doc.md:14"]
    assert cmds[2].files == {"/tmp/x/r.yaml": "model: {preset: tiny-falcon}\n"}


def test_a_later_block_reads_the_file_an_earlier_block_of_its_document_wrote():
    written = {}
    split_commands("cat > /tmp/x/r.yaml <<'EOF'\nmodel: {preset: tiny-falcon}\nEOF\n", ("doc.md", 3), files=written)
    (later,) = split_commands("falcon-fwa train --config /tmp/x/r.yaml\n", ("doc.md", 9), files=written)
    assert later.files == {"/tmp/x/r.yaml": "model: {preset: tiny-falcon}\n"}
    (alone,) = split_commands("falcon-fwa train --config /tmp/x/r.yaml\n", ("other.md", 1))
    assert alone.files == {}
    readers = [c for c in COMMANDS if "/tmp/fwa/tiny.yaml" in c.argv and c.where.startswith("docs/training.md")]
    assert readers and all("/tmp/fwa/tiny.yaml" in c.files for c in readers)


@pytest.mark.parametrize("line, message", [
    ("falcon-fwa trian --config configs/small/falcon-1a.3.yaml", "unknown command"),
    ("falcon-fwa generate --model m --prompt x --max-new-token 64", "unrecognized arguments: --max-new-token"),
    ("falcon-fwa data --train a.txt --tokenizer byte --out o --text-split paragraphs", "invalid choice"),
    ("falcon-fwa ppl --data a.txt", "required"),
    ("torchrun --nproc-per-nod=2 -m falcon_fwa.train.cli --config configs/small/falcon-1a.3.yaml",
     "unrecognized arguments"),
    ("torchrun --nproc_per_node=2 -m falcon_fwa.train.cly --config configs/small/falcon-1a.3.yaml", "no such module"),
    ("python -m falcon_fwa.train.compare_report a.json", "required"),
    ("python benchmarks/bench_decode.py --cuda-graph", "unrecognized arguments: --cuda-graph"),
    ("python benchmarks/bench_decod.py", "no file of the repository"),
    ("falcon-fwa train --config configs/small/falcon-1a3.yaml", "no file of the repository"),
    ("falcon-fwa train --config configs/small/falcon-1a.3.yaml --set data.train_source=t.txt --set train.step=10",
     "unknown config field train.step"),
    ("falcon-fwa train --config configs/small/falcon-1a.3.yaml --set data.train_source=t.txt "
     "--set model.overrides.rulee=2A", "rulee"),
    ("falcon-fwa train --config configs/small/falcon-1a.3.yaml --set train.steps=0", "train.steps must be >= 1"),
    ("bash benchmarks/gpu_suite.py OUT", "no file of the repository"),
    ("falcon-fwa ppl --model m --data results/lm/nope.txt", "no file of the repository"),
    ("wget x", "neither a command of the project nor a known tool"),
])
def test_checker_refuses(line, message, tmp_path):
    with pytest.raises((AssertionError, pytest.fail.Exception), match=re.escape(message)):
        check_command(_cmd(line), tmp_path)


def test_checker_reads_a_recipe_the_block_writes(tmp_path):
    recipe = "model: {preset: tiny-falcon}\ndata: {train_source: t.txt}\noptim: {warmup_steps: 2}\ntrain: {steps: 4}\n"
    check_command(_cmd("falcon-fwa train --config /tmp/r.yaml --set train.steps=8", {"/tmp/r.yaml": recipe}),
                  tmp_path)
    with pytest.raises(pytest.fail.Exception, match="unknown config field log.evry"):
        check_command(_cmd("falcon-fwa train --config /tmp/r.yaml --set log.evry=2", {"/tmp/r.yaml": recipe}),
                      tmp_path)


@pytest.mark.parametrize("span, message", [
    ("python benchmarks/bench_kernels.py --pairedd 15", "no option --pairedd"),
    ("python benchmarks/bench_decode.py [--cuda-graph]", "no option --cuda-graph"),
    ("falcon-fwa throughput --compiled --preset falcon-1a.3-130m", "no option --compiled"),
    ("falcon-fwa thruput --compile", "unknown command"),
    ("torchrun ... -m falcon_fwa.train.cli --configs configs/paper/<model>.yaml", "no option --configs"),
    ("falcon-fwa compare --configs configs/small/{falcon-1a.3,falcon-9}.yaml ...", "configs/small/falcon-9.yaml"),
    ("bash benchmarks/gpu_suite.sh OUT {tests,kernel}", "no stage 'kernel'"),
])
def test_inline_checker_refuses(span, message):
    with pytest.raises((AssertionError, pytest.fail.Exception), match=re.escape(message)):
        check_inline(Inline("test:1", span.replace("[", " ").replace("]", " ").split()))


def test_inline_options_belong_to_the_documents_commands():
    text = ("Train with `falcon-fwa addition` (or\n`falcon-fwa generate --model DIR`), `--base 2`,\n\n"
            "| a | `python benchmarks/bench_kernels.py` (`--paired 15`, `--cudagraphs`) |\n\n"
            "```bash\nfalcon-fwa ppl --model m --data d\n```\nthen `--max-windows 4`, `--max-window 4` "
            "and `--seed=1`.\n")
    blocks = [c for _, line, t in _fenced_blocks_of(text) for c in split_commands(t, ("doc.md", line))]
    commands, _ = inline_spans(text, "doc.md")
    assert [(c.where, c.words[:2]) for c in commands] == [
        ("doc.md:1", ["falcon-fwa", "addition"]), ("doc.md:2", ["falcon-fwa", "generate"]),
        ("doc.md:4", ["python", "benchmarks/bench_kernels.py"])]
    assert unknown_options(text, "doc.md", blocks) == ["doc.md:4: --cudagraphs", "doc.md:9: --max-window"]
