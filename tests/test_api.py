"""The public API (adaptree.load -> Pipeline), per-model assets and the package layering, on tiny models."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from conftest import ToyTokenizer

import adaptree
from adaptree.methods import METHODS, MissingAssetError

SRC = Path(adaptree.__file__).resolve().parent


@pytest.fixture(scope="module")
def pipe(tiny_folders):
    model, head = tiny_folders
    loaded = adaptree.load(model, head=head, dtype="float32")
    assert loaded.head_folder == head and loaded.dtype == torch.float32
    return adaptree.api.Pipeline(loaded.target, ToyTokenizer(), loaded.head, model=str(model), head_folder=head)


def test_generate_returns_text_ids_and_cycles(pipe):
    ar = pipe.generate("the cat sat", method="ar", max_new_tokens=12)
    st = pipe.generate("the cat sat", method="static", max_new_tokens=12, width=3, depth=3, size=6)
    assert st.token_ids == ar.token_ids  # float32 greedy: lossless
    assert st.text == pipe.tokenizer.decode(st.token_ids) and st.prompt_ids == pipe.encode("the cat sat")
    assert st.method == "static" and st.cycles and st.tau >= 1.0 and ar.tau == 1.0
    assert sum(c.emitted for c in st.cycles) + 1 >= len(st.token_ids) >= 1
    # messages and ids are prompts too; a controller built elsewhere is accepted
    msgs = [{"role": "user", "content": "the cat sat"}]
    assert pipe.generate(msgs, max_new_tokens=12).token_ids == ar.token_ids
    ctl = pipe.controller("deagle", width=3, depth=4, size=8)
    assert pipe.generate(st.prompt_ids, controller=ctl, max_new_tokens=12).token_ids == ar.token_ids


def test_stream_yields_the_text_and_can_be_closed(pipe):
    whole = pipe.generate("the cat sat", method="static", max_new_tokens=16)
    s = pipe.stream("the cat sat", method="static", max_new_tokens=16)
    pieces = list(s)
    assert len(pieces) > 1 and "".join(pieces) == whole.text and s.generation.token_ids == whole.token_ids
    s = pipe.stream("the cat sat", method="ar", max_new_tokens=200)
    next(iter(s))
    s.close()  # stops at the next cycle; the engine is free again
    assert s.generation is None
    assert pipe.generate("the cat sat", method="ar", max_new_tokens=16).token_ids == whole.token_ids


def test_bad_arguments_name_the_bad_value(pipe, tiny_folders):
    with pytest.raises(ValueError, match="unknown method 'fast'"):
        pipe.generate("hi", method="fast")
    with pytest.raises(ValueError, match="method 'deagle'.*'wdith'"):
        pipe.generate("hi", method="deagle", wdith=3)
    with pytest.raises(ValueError, match="temperature"):
        pipe.generate("hi", sampling={"temperature": -1.0})
    with pytest.raises(ValueError, match="dtype 'float8'"):
        adaptree.load(tiny_folders[0], head=None, dtype="float8")
    with pytest.raises(ValueError, match="needs a draft head"):
        adaptree.load(tiny_folders[0], head=None, dtype="float32").generate("hi", method="static")


def test_a_draft_model_loads_with_the_target_and_drafts_losslessly(tiny_folders):
    model, _ = tiny_folders
    p = adaptree.load(model, head=None, dtype="float32", draft_model=model, adapt=False)
    assert p.draft_model is not None and p.draft_model is not p.target
    assert p.settings()["draft_model"] == str(model) and p.settings()["draft_model_sha256"]
    ids = [1, 5, 7, 9]
    ar = p.generate(ids, method="ar", max_new_tokens=12)
    dm = p.generate(ids, method="draft-model", max_new_tokens=12, tokens=3)
    assert dm.token_ids == ar.token_ids and dm.tau > 1.0  # the same weights: every proposal is accepted
    assert p.generate(ids, method="ngram", max_new_tokens=12).token_ids == ar.token_ids  # no head needed either
    with pytest.raises(ValueError, match="needs a draft model"):
        adaptree.load(model, head=None, dtype="float32", adapt=False).generate(ids, method="draft-model")
    with pytest.raises(ValueError, match="draft_model='auto'.*registered for"):
        adaptree.load(model, head=None, dtype="float32", adapt=False, draft_model="auto")


def test_registered_siblings_share_a_tokenizer_family():
    from adaptree.models import MODELS, sibling_draft_model

    assert sibling_draft_model("qwen2.5-coder-1.5b") == "qwen2.5-coder-0.5b"
    assert sibling_draft_model("Qwen2.5-Coder-1.5B") == "qwen2.5-coder-0.5b"
    assert sibling_draft_model(None) is None and sibling_draft_model(Path("qwen2.5-coder-1.5b")) is None
    for name, entry in MODELS.items():  # a sibling is registered and is not its own draft
        assert entry.draft_model is None or (entry.draft_model in MODELS and entry.draft_model != name)


@pytest.mark.parametrize("method, what, command, missing", [
    ("ltd", "needs an LTD depth policy", "adaptree train ltd", "ltd/depth/config.json"),
    ("ltd-size", "needs an LTD size policy", "adaptree train ltd", "ltd/size/config.json"),
    ("radar", "needs a RADAR policy", "adaptree radar train", "radar/config.json"),
    ("resps", "needs a Re-SpS policy", "adaptree train resps", "resps/config.json"),
    ("static-gs", "needs a tuned static tree", "adaptree tune-static", "static_gs.json"),
])
def test_missing_assets_name_the_model_the_file_and_the_command(pipe, tiny_folders, method, what, command, missing,
                                                                capsys):
    model, head = tiny_folders
    with pytest.raises(MissingAssetError) as err:
        pipe.generate("hi", method=method)
    text = str(err.value)
    assert str(model) in text and str(head / missing) in text and command in text, text
    assert f"method {method!r} {what} for" in text, text
    # the same on the command line: a clear error, exit code 2, no traceback
    from adaptree.cli import main

    code = main(["generate", "hi", "--model", str(model), "--draft", str(head), "--dtype", "float32",
                 "--method", method, "--max-new-tokens", "4"])
    err_text = capsys.readouterr().err
    assert code == 2 and command in err_text and str(head / missing) in err_text and "Traceback" not in err_text


def test_assets_next_to_the_head_in_use_are_found(pipe, tiny_folders, tmp_path):
    import json
    import shutil

    _, head = tiny_folders
    own = tmp_path / "head"
    shutil.copytree(head, own)
    (own / "static_gs.json").write_text(json.dumps({"width": 3, "depth": 2, "size": 5}))
    p = adaptree.api.Pipeline(pipe.target, pipe.tokenizer, pipe.head, model="tiny", head_folder=own)
    ctl = p.controller("static-gs")
    assert (ctl.config.width, ctl.config.depth, ctl.config.size) == (3, 2, 5)


# ------------------------------------------------------------------------------------------------ layering

LAYERS = ("_lazy", "_version", "core", "models", "data", "offline", "methods", "head_training", "adapt", "vllm_plugin",
          "bench", "serve", "api", "adaptree", "cli")
"""The package's layers, lowest first: a module imports only from its own layer or lower ones (at the top, in
functions and under TYPE_CHECKING alike). ``_lazy`` and ``_version`` are the root package's helpers; ``adaptree``
is the root package itself (it re-exports the API); ``cli`` is the command line on top of everything."""

PACKAGES = tuple(name for name in LAYERS if not name.startswith("_") and name != "adaptree")


def _module(path: Path) -> str:
    return ".".join(path.relative_to(SRC.parent).with_suffix("").parts).removesuffix(".__init__")


def _package(path: Path) -> list[str]:
    """The package ``path``'s relative imports start from (``adaptree.x`` for ``adaptree/x/y.py`` and for
    ``adaptree/x/__init__.py``)."""
    return list(path.relative_to(SRC.parent).with_suffix("").parts[:-1])


def _import_nodes(tree: ast.AST, package: list[str]):
    """``(node, module)`` for every import in ``tree`` (relative ones resolved from ``package``), wherever it is."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                yield node, ".".join(base + ([node.module] if node.module else []))
            else:
                yield node, node.module or ""
        elif isinstance(node, ast.Import):
            for a in node.names:
                yield node, a.name


def _ours(module: str) -> bool:
    return module == "adaptree" or module.startswith("adaptree.")


def _imports(path: Path) -> set[str]:
    """Every adaptree module ``path`` imports (top level, in functions and under TYPE_CHECKING)."""
    return {n for _, n in _import_nodes(ast.parse(path.read_text()), _package(path)) if _ours(n)}


def _layer(module: str) -> str:
    """The layer of an adaptree module: its top-level package (or root module), ``adaptree`` for the root."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "adaptree"


def _unit(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else None


def _sources():
    return sorted(SRC.rglob("*.py"))


def test_the_library_never_imports_the_cli_and_packages_form_no_cycle():
    edges: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for path in _sources():
        mod = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
        src = _unit(mod)
        if src is None:
            continue
        for dep in _imports(path):
            dst = _unit(dep)
            if dst == "cli":
                assert src == "cli", f"{path.relative_to(SRC)} imports the command line ({dep})"
            if dst and dst != src:
                edges[src].add(dst)
    # depth-first search for a cycle between packages
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                raise AssertionError("import cycle between packages: " + " -> ".join(trail + [node, nxt]))
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for p in PACKAGES:
        if p not in state:
            visit(p, [])
    assert "cli" not in set().union(*(edges[p] for p in PACKAGES if p != "cli"))


def test_every_module_imports_only_its_own_layer_or_lower_ones():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = []
    for path in _sources():
        src = _layer(_module(path))
        assert src in rank, f"{path.relative_to(SRC)}: {src!r} has no place in LAYERS; add it where it belongs"
        for node, dep in _import_nodes(ast.parse(path.read_text()), _package(path)):
            if not _ours(dep):
                continue
            dst = _layer(dep)
            assert dst in rank, f"{path.relative_to(SRC)}:{node.lineno} imports {dep}, which has no place in LAYERS"
            if rank[dst] > rank[src]:
                upward.append(f"{path.relative_to(SRC)}:{node.lineno} ({src}) imports {dep} ({dst})")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _owner(module: str) -> str:
    """The layer a private name in ``module`` belongs to; a private module of the root package (``adaptree._lazy``)
    belongs to the whole package."""
    parts = module.split(".")
    return "adaptree" if len(parts) > 1 and _private(parts[1]) else _layer(module)


def _is_module(name: str) -> bool:
    rel = Path(*name.split(".")[1:])
    return (SRC / rel).with_suffix(".py").is_file() or (SRC / rel / "__init__.py").is_file()


def _private_uses(source: str, module: str, package: list[str]) -> list[str]:
    """Private names (a leading underscore) of another layer that the module ``module`` (its ``source``) imports,
    or reads as an attribute of a module it imported (``from adaptree.x import y; y._z``)."""
    src = _layer(module)
    tree = ast.parse(source)
    found, modules = [], {}  # modules: local name -> the adaptree module it is bound to
    for node, dep in _import_nodes(tree, package):
        if not _ours(dep):
            continue
        foreign = _owner(dep) not in ("adaptree", src)
        if foreign and any(_private(p) for p in dep.split(".")[2:]):
            found.append(f"{module}:{node.lineno} imports the private module {dep}")
        if isinstance(node, ast.ImportFrom):
            for a in node.names:
                if _is_module(f"{dep}.{a.name}"):
                    modules[a.asname or a.name] = f"{dep}.{a.name}"
                elif foreign and _private(a.name):
                    found.append(f"{module}:{node.lineno} imports {a.name} from {dep}")
        else:
            for a in node.names:
                if a.name == dep:  # ``import adaptree.x.y`` binds adaptree, ``import adaptree.x.y as m`` binds m
                    modules[a.asname or "adaptree"] = dep if a.asname else "adaptree"
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Attribute) and _private(node.attr)):
            continue
        chain, value = [], node.value
        while isinstance(value, ast.Attribute):
            chain.append(value.attr)
            value = value.value
        if isinstance(value, ast.Name) and value.id in modules:
            owner = ".".join([modules[value.id], *reversed(chain)])
            if _is_module(owner) and _owner(owner) not in ("adaptree", src):
                found.append(f"{module}:{node.lineno} reads {owner}.{node.attr}")
    return found


def test_no_module_uses_another_layers_private_names():
    found = [use for path in _sources()
             for use in _private_uses(path.read_text(), _module(path), _package(path))]
    assert not found, "private names used across packages (make them public or move them):\n" + "\n".join(found)


def test_the_private_name_check_sees_imports_and_attributes():
    """The check itself: a module of ``cli`` importing ``api._load`` or reading ``adaptree.api._prepare`` is caught; a
    private name of its own package and the root package's helpers are not."""
    source = ("from adaptree.api import _load\nimport adaptree.api\nfrom adaptree._lazy import lazy_exports\n"
              "from adaptree.cli.common import _x\nfrom . import common\ncommon._y\nadaptree.api._prepare\n")
    found = _private_uses(source, "adaptree.cli.probe", ["adaptree", "cli"])
    assert len(found) == 2, found
    assert "imports _load from adaptree.api" in found[0] and "reads adaptree.api._prepare" in found[1]


def test_the_pipeline_is_what_adapt_bench_and_serve_type_their_pipeline_as(pipe):
    """:class:`adaptree.api.Pipeline` satisfies :class:`~adaptree.core.pipeline.PipelineLike`: an instance passes
    the runtime check, and every method and property the protocol names is one of Pipeline's, taking the
    protocol's parameters."""
    import inspect

    from adaptree.api import Pipeline
    from adaptree.core.pipeline import PipelineLike

    assert isinstance(pipe, PipelineLike)
    members = [n for n, v in vars(PipelineLike).items() if not n.startswith("_") and (callable(v) or
                                                                                       isinstance(v, property))]
    assert {"encode", "controller", "settings", "execution", "model_label"} <= set(members)
    for name in members:
        ours, theirs = vars(PipelineLike)[name], inspect.getattr_static(Pipeline, name)
        assert isinstance(theirs, property) == isinstance(ours, property), name
        if isinstance(ours, property):
            continue
        want, have = inspect.signature(ours).parameters, inspect.signature(theirs).parameters
        for p in want.values():
            assert p.name in have and have[p.name].kind == p.kind and have[p.name].default == p.default, (name, p)
    for name in PipelineLike.__annotations__:  # data attributes: set on every pipeline
        assert hasattr(pipe, name), name

    # without ``execution`` an object is not a pipeline for adapt, bench or serve
    partial = type("Partial", (), {n: inspect.getattr_static(Pipeline, n) for n in members if n != "execution"})()
    for name in PipelineLike.__annotations__:
        setattr(partial, name, getattr(pipe, name))
    assert not isinstance(partial, PipelineLike)


def test_the_top_level_exports_resolve():
    for name in adaptree.__all__:
        assert getattr(adaptree, name) is not None
    assert set(METHODS) >= {"ar", "static", "static-gs", "deagle", "ltd", "radar", "resps"}


def test_load_without_adapting_never_measures(tiny_folders, tmp_path, monkeypatch):
    """adapt=False: no measurement (no cache folder appears), dtype auto falls back without timing, default ar."""
    import adaptree
    from adaptree.adapt.execution import fallback_dtype

    model, head = tiny_folders
    cache = tmp_path / "cache"
    monkeypatch.setenv("ADAPTREE_CACHE", str(cache))
    p = adaptree.load(model, head=head, adapt=False)
    assert p.machine is None and p.default_method == "ar"
    assert p.dtype_name == fallback_dtype("cpu")
    assert not (cache / "machines").exists()


def test_load_measures_once_then_finds_the_setup(tiny_folders, tmp_path, monkeypatch, capsys):
    """The first load measures (one line saying so, the execution mode chosen among bfloat16 and float32: a Hugging
    Face folder has no int4 blocks: both probed, the one kept set up fully), the second finds the cached setup and
    mode without measuring; the default method comes from the setup."""
    import json

    import adaptree

    model, head = tiny_folders
    monkeypatch.setenv("ADAPTREE_CACHE", str(tmp_path / "cache"))
    p = adaptree.load(model, head=head, adapt=True, progress=False)
    err = capsys.readouterr().err
    assert "choosing the execution mode by measurement among bfloat16, float32 " in err
    assert err.count("probe bfloat16:") == 1 and err.count("probe float32:") == 1, err
    (choice,) = (json.loads(f.read_text()) for f in (tmp_path / "cache" / "machines").glob("execution-*.json"))
    # the kept mode is set up fully (and a runner-up only where its probe still beats what the live check kept)
    assert err.count("measuring this machine once") == len(choice["set_up"]) >= 1 and p.execution in choice["set_up"]
    assert p.machine is not None and p.dtype_name in ("bfloat16", "float32")
    assert p.default_method == p.machine.default_method != "static"
    again = adaptree.load(model, head=head, adapt=True, progress=False)
    assert capsys.readouterr().err == "" and again.dtype_name == p.dtype_name
    assert again.machine.to_dict() == p.machine.to_dict()
    text = again.generate("one two three", max_new_tokens=6).text
    assert isinstance(text, str)
