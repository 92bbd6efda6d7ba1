"""Cross-references in the code and the docs name things that exist, and the code names no issues.

What is read: in ``src/adaptree/**/*.py`` every docstring (of a module, class or function, and the attribute
docstrings under a field) and every comment (consecutive comment lines as one text); ``README.md`` and
``docs/*.md`` whole. ``docs/results/**`` are dated records of what was measured then, under the names of then,
and are not read. For issue tags only, also the docstrings and comments of ``tests/**/*.py`` and
``scripts/*.py`` and the comment lines of ``scripts/*.sh`` (this file, which spells the pattern out, is not read).

What is checked in those texts:

- Sphinx roles ``:mod:``, ``:class:``, ``:func:``, ``:meth:``, ``:attr:``, ``:data:``, ``:exc:``, ``:obj:``:
  the target resolves, and a ``:mod:`` target is a module;
- dotted names that start with ``adaptree.`` (in backticks or not, also wrapped over a line break after a dot):
  they resolve as absolute paths; dotted names in backticks that start at a subpackage
  (``offline.family.cost_features``, ``adapt.compile.compile_tokens``) resolve under ``adaptree``;
  a dotted name that ends in a file suffix (``adaptree.json``) is a file's name and is not read;
- paths of Python files under this repository (``offline/envs.py``, ``src/adaptree/core/cycle.py``,
  ``tests/test_api.py``, ``scripts/chain_select.py``): the file exists. A path whose first folder is a
  subpackage of adaptree is relative to ``src/adaptree``; paths of other projects (``vllm/...``) are not read.

How a role's target resolves, as this repository writes them:

- ``~`` (show only the last name) and ``!`` (no link) in front, ``()`` behind, and a ``title <target>`` form
  are presentation only;
- a target that starts with dots is relative to the package of the module it is written in, as a relative
  import is: ``.chain.ChainSeam`` in ``adaptree/methods/common/runtime.py`` is
  ``adaptree.methods.common.chain.ChainSeam``; in a package's ``__init__.py`` it is relative to that package;
- any other target is tried, in order, in each class that encloses the text (innermost first), in the module
  it is written in (its attributes, and the names it imports, also under ``TYPE_CHECKING``), and as an
  absolute dotted path; in the docs, only as an absolute dotted path.

An absolute dotted path resolves by importing its longest module prefix and then ``getattr`` along the rest; on
a class a name also resolves when it is a dataclass field or an annotated attribute declared in the class (or
a base), or an attribute its methods assign (``self.name = ...``).
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import io
import re
import textwrap
import tokenize
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

import adaptree

SRC = Path(adaptree.__file__).resolve().parent
ROOT = SRC.parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = sorted(p for p in SRC.rglob("*.py") if "__pycache__" not in p.parts)
# this file is left out by its place under ROOT: the package may be installed from another checkout than this file's
OTHER_SOURCES = sorted(p for folder in ("tests", "scripts") for p in (ROOT / folder).rglob("*.py")
                       if "__pycache__" not in p.parts and p != ROOT / "tests" / Path(__file__).name)
"""The Python files outside the package, read for issue tags (their references are not resolved)."""
SHELL_SCRIPTS = sorted((ROOT / "scripts").glob("*.sh"))

ROLE = re.compile(r":(mod|class|func|meth|attr|data|exc|obj):`([^`]+)`")
DOTTED = re.compile(r"(?<![\w./-])adaptree(?:\.[A-Za-z_]\w*)+(?:\.[ \t]*\n[ \t]*[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)*")
PY_PATH = re.compile(r"(?<![\w./-])((?:[A-Za-z_][\w-]*/)+[A-Za-z_]\w*\.py)\b")
SUBPACKAGES = sorted(p.name for p in SRC.iterdir() if (p / "__init__.py").is_file())
SHORT = re.compile(r"`{1,2}((?:%s)(?:\.[A-Za-z_]\w*)+)(?:\(\))?`{1,2}" % "|".join(SUBPACKAGES))
"""A dotted name in backticks that starts at a subpackage of adaptree (``offline.family.cost_features``)."""
ISSUE = re.compile(r"\bissues?\b(?!\s+(?:a|an|the|one|its|their)\b)|(?<![\w&])#\d+\b", re.IGNORECASE)
"""An issue named as such (the noun, not "issues a request") or as ``#19``."""
REPO_FOLDERS = ("src", "tests", "scripts")
FILE_SUFFIXES = {"json", "jsonl", "md", "txt", "toml", "yaml", "csv", "log", "pt", "bin", "safetensors", "gguf"}
"""A dotted name ending in one of these is a file's name (``adaptree.json``), not a Python path."""


@dataclasses.dataclass(frozen=True)
class Text:
    """One docstring, comment block or document, with where it was written."""

    path: Path
    line: int  # of the text's first line in its file
    body: str
    module: str | None = None  # dotted name of the module it is written in (None: a document)
    classes: tuple[str, ...] = ()  # qualified names of the enclosing classes, innermost first

    def where(self, offset: int) -> str:
        """``file:line`` of a position in the body."""
        return f"{shown(self.path)}:{self.line + self.body.count(chr(10), 0, offset)}"


@dataclasses.dataclass(frozen=True)
class Reference:
    text: Text
    kind: str  # a role ("class", "mod", ...), "dotted", "short" (from a subpackage on) or "path"
    target: str
    offset: int  # in text.body

    def where(self) -> str:
        return f"{self.text.where(self.offset)}: {self.kind} {self.target!r}"


# --- reading docstrings, comments and documents -----------------------------------------------------------------


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def class_spans(tree: ast.Module) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every class in a module, outer classes first (a method's texts
    belong to its class; a class defined inside a function gets a name no getattr reaches, and its texts resolve
    in the module)."""
    spans = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                spans.append((child.lineno, child.end_lineno, prefix + child.name))
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return spans


def enclosing(spans: list[tuple[int, int, str]], line: int) -> tuple[str, ...]:
    return tuple(name for first, last, name in reversed(spans) if first <= line <= last)


def source_texts(path: Path, module: str | None = None) -> Iterator[Text]:
    """The docstrings (every string that is a statement of its own) and comment blocks of one source file, written
    in ``module`` (by default, the module of ``path`` under ``src``; None outside it)."""
    source = path.read_text()
    tree = ast.parse(source)
    spans, module = class_spans(tree), module or (module_name(path) if path.is_relative_to(SRC) else None)
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            yield Text(path, node.lineno, node.value.value, module, enclosing(spans, node.lineno))
    block: list[str] = []
    start = previous = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        if block and line != previous + 1:
            yield Text(path, start, "\n".join(block), module, enclosing(spans, start))
            block = []
        if not block:
            start = line
        block.append(tok.string.lstrip("#").strip())
        previous = line
    if block:
        yield Text(path, start, "\n".join(block), module, enclosing(spans, start))


def shell_comments(path: Path) -> Iterator[Text]:
    """The comment blocks of a shell script: consecutive lines that start with ``#`` (the ``#!`` line left out)."""
    block: list[str] = []
    start = 0
    for number, line in enumerate([*path.read_text().splitlines(), ""], start=1):
        comment = line.lstrip().startswith("#") and not line.startswith("#!")
        if comment:
            start = start if block else number
            block.append(line.lstrip().lstrip("#").strip())
        elif block:
            yield Text(path, start, "\n".join(block))
            block = []


def all_texts() -> Iterator[Text]:
    for path in SOURCES:
        yield from source_texts(path)
    for path in DOCS:
        yield Text(path, 1, path.read_text())


def references(text: Text) -> Iterator[Reference]:
    roles = list(ROLE.finditer(text.body))
    for m in roles:
        yield Reference(text, m.group(1), re.sub(r"\s+", "", m.group(2)), m.start())
    for m in DOTTED.finditer(text.body):
        name = re.sub(r"\s+", "", m.group(0))
        if name.rpartition(".")[2] in FILE_SUFFIXES or any(r.start() <= m.start() < r.end() for r in roles):
            continue  # a file's name; a role's target (checked as the role)
        yield Reference(text, "dotted", name, m.start())
    for m in SHORT.finditer(text.body):
        if m.group(1).rpartition(".")[2] not in FILE_SUFFIXES:
            yield Reference(text, "short", m.group(1), m.start())
    for m in PY_PATH.finditer(text.body):
        yield Reference(text, "path", m.group(1), m.start())


# --- resolving ----------------------------------------------------------------------------------------------------


MISSING = object()
UNCHECKED = object()
"""What a name in a module that needs an optional package, absent here, stands for: it is not checked in this
environment (CI checks it again where the package is installed: .ci/run's vLLM pass)."""
OPTIONAL = ("vllm",)
"""Optional packages whose modules import them at the top (adaptree.vllm_plugin's scheduler subclasses vLLM's)."""
"""What a name that names nothing resolves to (None is a value a name may have)."""


class Declared:
    """An attribute a class declares (an annotation, a dataclass field, ``self.name = ...``) without a class-level
    value to get."""

    def __init__(self, owner: type, name: str):
        self.owner, self.name = owner, name


@cache
def assigned_attributes(cls: type) -> frozenset[str]:
    """The names ``cls``'s own methods assign as ``self.name``."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return frozenset()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and isinstance(node.value, ast.Name):
            if node.value.id == "self":
                names.add(node.attr)
    return frozenset(names)


def member(obj: object, name: str) -> object:
    """``obj.name`` as documentation means it (a class's declared attributes included), or :data:`MISSING`."""
    if isinstance(obj, Declared):
        return MISSING
    try:
        return inspect.getattr_static(obj, name) if isinstance(obj, type) else getattr(obj, name)
    except AttributeError:
        pass
    except ModuleNotFoundError as e:  # a module attribute built from an optional package on first use
        if e.name is not None and e.name.partition(".")[0] in OPTIONAL:
            return UNCHECKED
        raise
    if isinstance(obj, type):
        for klass in obj.__mro__:
            declared = name in vars(klass).get("__annotations__", {}) or name in assigned_attributes(klass)
            if declared or (dataclasses.is_dataclass(klass) and name in {f.name for f in dataclasses.fields(klass)}):
                return Declared(klass, name)
    return MISSING


def absolute(path: str) -> object:
    """What the absolute dotted ``path`` names: its longest importable module prefix, then attributes."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        name = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name is not None and not name.startswith(e.name):
                if e.name.partition(".")[0] in OPTIONAL:
                    return UNCHECKED
                raise  # the module exists but imports something missing: a real error, not a wrong name
            continue
        for part in parts[cut:]:
            obj = member(obj, part)
            if obj is MISSING:
                return MISSING
        return obj
    return MISSING


@cache
def imported_names(module: str) -> dict[str, str]:
    """Each name ``module`` imports (also under ``TYPE_CHECKING``) -> the absolute dotted path it stands for."""
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is not None and e.name.partition(".")[0] in OPTIONAL:
            return {}
        raise
    package = mod.__name__ if hasattr(mod, "__path__") else mod.__name__.rpartition(".")[0]
    names = {}
    for node in ast.walk(ast.parse(inspect.getsource(mod))):
        if isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package) if node.level \
                else node.module
            for alias in node.names:
                names[alias.asname or alias.name] = f"{base}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.partition(".")[0]] = alias.name if alias.asname else \
                    alias.name.partition(".")[0]
    return names


def candidates(target: str, module: str | None, classes: tuple[str, ...]) -> list[str]:
    """The absolute dotted paths ``target`` may stand for, in the order they are tried (see the module docstring)."""
    if target.startswith("."):
        if module is None:
            return []  # a document has no package to be relative to
        package = module if hasattr(importlib.import_module(module), "__path__") else module.rpartition(".")[0]
        return [importlib.util.resolve_name(target, package)]
    paths = []
    if module is not None:
        paths += [f"{module}.{cls}.{target}" for cls in classes] + [f"{module}.{target}"]
        head, _, rest = target.partition(".")
        if head in imported_names(module):
            paths.append(imported_names(module)[head] + (f".{rest}" if rest else ""))
    return paths + [target]


def clean(target: str) -> str:
    """The target of a role without its presentation: ``title <target>``, ``~``, ``!`` and ``()``."""
    if target.endswith(">") and "<" in target:
        target = target[target.rindex("<") + 1:-1]
    target = target.lstrip("~!")
    return target.removesuffix("()")


def resolves(kind: str, target: str, module: str | None = None, classes: tuple[str, ...] = ()) -> bool:
    """Whether a reference names something (for ``:mod:``, a module), written in ``module`` inside ``classes``."""
    if kind == "path":
        first = target.split("/")[0]
        base = ROOT if first in REPO_FOLDERS else SRC.parent if first == "adaptree" else SRC
        return (base / target).is_file()
    if kind in ("dotted", "short"):
        return absolute(target if kind == "dotted" else f"adaptree.{target}") is not MISSING
    paths = candidates(clean(target), module, classes)
    return any((obj := absolute(path)) is not MISSING
               and (kind != "mod" or obj is UNCHECKED or inspect.ismodule(obj)) for path in paths)


def checked(ref: Reference) -> bool:
    """Whether a reference is this repository's to resolve (a path of another project is not)."""
    if ref.kind != "path":
        return True
    first = ref.target.split("/")[0]
    return first in REPO_FOLDERS or first == "adaptree" or (SRC / first).is_dir()


# --- the tests ------------------------------------------------------------------------------------------------------


def test_every_reference_in_the_code_and_the_docs_resolves():
    refs = [ref for text in all_texts() for ref in references(text) if checked(ref)]
    assert len(refs) > 500  # the reader found the references (a broken pattern would find none and pass)
    stale = [ref.where() for ref in refs if not resolves(ref.kind, ref.target, ref.text.module, ref.text.classes)]
    assert not stale, "references to nothing:\n" + "\n".join(stale)


def test_no_docstring_or_comment_names_an_issue():
    """Code says why; the history (which issue asked for what, what was measured then) is in the docs. The same
    holds in the tests and the scripts."""
    texts = [*(text for path in [*SOURCES, *OTHER_SOURCES] for text in source_texts(path)),
             *(text for path in SHELL_SCRIPTS for text in shell_comments(path))]
    assert {text.path.parent.name for text in texts} >= {"adaptree", "tests", "scripts"}  # all three were read
    tagged = [f"{text.where(m.start())}: {text.body[max(0, m.start() - 30):m.end() + 30]!r}"
              for text in texts for m in ISSUE.finditer(text.body)]
    assert not tagged, "docstrings and comments that name an issue:\n" + "\n".join(tagged)


@pytest.mark.parametrize("kind, target, module, classes", [
    ("class", "~adaptree.core.tree.DraftTree", None, ()),
    ("mod", ".chain", "adaptree.methods.common.runtime", ()),
    ("class", "~.chain.ChainSeam", "adaptree.methods.common.runtime", ()),
    ("mod", ".ngram", "adaptree.methods", ()),  # in a package's __init__: relative to that package
    ("func", "load", "adaptree", ()),  # a lazily exported name
    ("meth", "Pipeline.generate", "adaptree", ()),
    ("attr", "Pipeline.generate()", "adaptree.api", ()),
    ("class", "LatencyModel", "adaptree.offline.oracle", ()),  # a name the module imports
    ("attr", "temperature", "adaptree.core.verify", ("SamplingConfig",)),  # a field of the enclosing class
    ("attr", "adaptree.core.verify.SamplingConfig.temperature", None, ()),
    ("attr", "adaptree.core.controller.CycleContext.index", None, ()),  # a field whose default is None
    ("dotted", "adaptree.offline.family", None, ()),
    ("short", "offline.family.cost_features", None, ()),
    ("path", "core/cycle.py", None, ()),
    ("path", "adaptree/core/cycle.py", None, ()),
    ("path", "tests/test_references.py", None, ()),
])
def test_the_resolver_finds_what_exists(kind, target, module, classes):
    assert resolves(kind, target, module, classes)


@pytest.mark.parametrize("kind, target, module, classes", [
    ("class", "~adaptree.engine.Engine", None, ()),  # a module that no longer exists
    ("func", "adaptree.rl.latency.calibrate", None, ()),
    ("class", "adaptree.core.tree.NoSuchTree", None, ()),  # a missing name in a module that exists
    ("attr", "adaptree.core.verify.SamplingConfig.no_such_field", None, ()),
    ("mod", "adaptree.core.tree.DraftTree", None, ()),  # not a module
    ("mod", ".nowhere", "adaptree.methods", ()),
    ("class", "ChainSeam", "adaptree.core.cycle", ()),  # neither in that module nor absolute
    ("class", ".chain.ChainSeam", None, ()),  # relative, in a document
    ("dotted", "adaptree.offline.family.NO_FEATURES", None, ()),
    ("short", "methods.hybrid.chain.ChainRule", None, ()),
    ("path", "methods/hybrid/chain.py", None, ()),
    ("path", "tests/test_nothing.py", None, ()),
])
def test_the_resolver_rejects_what_does_not(kind, target, module, classes):
    assert not resolves(kind, target, module, classes)


def test_a_planted_stale_reference_is_found(tmp_path):
    """The reader and the resolver together: a docstring, a comment and an attribute docstring with dead names."""
    code = tmp_path / "planted.py"
    code.write_text('"""See :func:`~adaptree.rl.simulator.simulate` and adaptree.offline.family.\n'
                    '   NO_FEATURES, :func:`run_cycles`."""\n\n\nclass A:\n'
                    '    # the :class:`~.tree.DraftTree` of offline/nowhere.py\n'
                    '    x: int\n    """Read by :meth:`value`."""\n')
    texts = list(source_texts(code, module="adaptree.core.cycle"))  # as if it were that module
    refs = [r for t in texts for r in references(t)]
    assert {(r.kind, r.target) for r in refs} == {
        ("func", "~adaptree.rl.simulator.simulate"), ("dotted", "adaptree.offline.family.NO_FEATURES"),
        ("func", "run_cycles"), ("class", "~.tree.DraftTree"), ("path", "offline/nowhere.py"), ("meth", "value")}
    dead = {r.target for r in refs if not resolves(r.kind, r.target, r.text.module, r.text.classes)}
    # run_cycles is adaptree.core.cycle's, DraftTree is in adaptree.core.tree; class A has no method value
    assert dead == {"~adaptree.rl.simulator.simulate", "adaptree.offline.family.NO_FEATURES", "offline/nowhere.py",
                    "value"}
    comment = next(t for t in texts if t.body.startswith("the"))
    assert comment.classes == ("A",) and comment.line == 6
    assert next(r for r in refs if r.target == "value").where().endswith(":8: meth 'value'")


def test_the_issue_pattern():
    for tagged in ["(issue 7)", "Issue 16", "issues 16 and", "see #19", "as the issue counts it", "issue #3",
                   "(issue goal: 10%)"]:
        assert ISSUE.search(tagged), tagged
    for clean_text in ["tissue 7", "the server issues a 400", "it issues one request", "a #-comment", "#include",
                       "&#39;"]:
        assert not ISSUE.search(clean_text), clean_text


def test_a_planted_issue_tag_is_found(tmp_path):
    code = tmp_path / "planted.py"
    code.write_text('"""Fast enough."""\n\nLIMIT = 3\n"""The cap (Issue 16)."""\n\n\ndef f():\n'
                    '    return 1  # measured in issue 7\n')
    found = [text.where(m.start()).rpartition(":")[2] for text in source_texts(code, module="adaptree.core.cycle")
             for m in ISSUE.finditer(text.body)]
    assert sorted(found) == ["4", "8"]


def test_a_planted_issue_tag_in_a_shell_script_is_found(tmp_path):
    script = tmp_path / "planted.sh"
    script.write_text("#!/usr/bin/env bash\n# Runs the sweep.\nset -e\n  # measured in issue 17\necho 'issue 3'\n"
                      "# two lines,\n# see #19\n")
    texts = list(shell_comments(script))
    assert [(t.line, t.body) for t in texts] == [(2, "Runs the sweep."), (4, "measured in issue 17"),
                                                 (6, "two lines,\nsee #19")]
    found = [text.where(m.start()).rpartition(":")[2] for text in texts for m in ISSUE.finditer(text.body)]
    assert found == ["4", "7"]
