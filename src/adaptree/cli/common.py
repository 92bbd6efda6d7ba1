"""What the commands share: flags generated from typed configs, the method flags of the registry, and the model
flags with :func:`load_pipeline`.

A config dataclass documents each field with the string right below it; :class:`ConfigFlags` turns every field
into a flag whose type, default and help text come from there (the help is that docstring), so a default and
its help live in one place. Flags only a command has (``--model``, ``--json``, ...) are written by hand.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import textwrap
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adaptree.core.config import FLAG_HELP, Bounds, bounds_of, choices_of

# ------------------------------------------------------------------------------------------------ value types


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


_NOUNS = {int: "integers", float: "numbers", positive_int: "integers >= 1"}


def device_type(text: str) -> str:
    """A ``--device`` value: ``cpu``, ``cuda`` or ``cuda:N`` of a device this machine has (checked here, so a bad value
    fails before a model is loaded)."""
    import torch

    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device: use cpu, cuda or cuda:N") from None
    if dev.type not in ("cpu", "cuda"):
        raise argparse.ArgumentTypeError(f"device {text!r}: adaptree runs on cpu or cuda, not {dev.type}")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"device {text!r}: this torch ({torch.__version__}) sees no CUDA device")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(f"device {text!r}: this machine has {torch.cuda.device_count()} CUDA "
                                             f"device(s), cuda:0..cuda:{torch.cuda.device_count() - 1}")
    return text


def comma_type(convert: Callable[[str], Any] = int, container: type = tuple, allow_empty: bool = False):
    """argparse type: ``"4,8,10"`` -> ``(4, 8, 10)`` (``container`` of ``convert``-ed items, blanks skipped)."""

    def parse(text: str):
        from adaptree.core.controller import comma_list

        try:
            out = container(comma_list(text, convert))
        except argparse.ArgumentTypeError as e:
            if convert not in _NOUNS:  # a config field's range: its message names the field and the item
                raise argparse.ArgumentTypeError(f"{e} in {text!r}") from None
            raise argparse.ArgumentTypeError(f"expected comma-separated {_NOUNS[convert]}, got {text!r}") from None
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated {_NOUNS.get(convert, 'values')}, "
                                             f"got {text!r}") from None
        if not out and not allow_empty:
            raise argparse.ArgumentTypeError(f"expected at least one of the comma-separated {_NOUNS.get(convert, 'values')}")
        return out

    parse.__name__ = f"{getattr(convert, '__name__', 'value')}_list"
    return parse


def writable_file(path: str) -> Path:
    """``path`` once its folder is created and proved writable (before any model is loaded)."""
    from adaptree.offline.runs import check_out_dir

    p = Path(path)
    check_out_dir(p.parent, for_file=str(path))
    return p


# ---------------------------------------------------------------------------------------- field docstrings


@functools.cache
def _own_docs(cls: type) -> dict[str, str]:
    """Field name -> the string literal right below its annotation, for the fields ``cls``'s own body declares."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError, SyntaxError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            out[node.target.id] = after.value.value
    return out


_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def plain(text: str, escape: bool = True) -> str:
    """A docstring as one line of command-line help: reST roles and literals unwrapped, ``None`` said as
    "unset", ``%`` escaped for argparse's help strings (``escape``)."""
    text = _ROLE.sub(lambda m: m.group(1).rsplit(".", 1)[-1], text)
    text = text.replace("``", "")
    text = " ".join(re.sub(r"\bNone\b", "unset", text).split())
    return text.replace("%", "%%") if escape else text


def field_doc(cls: type, name: str) -> str:
    """The docstring of field ``name`` of dataclass ``cls`` (from the class that declares it last), as help."""
    for klass in cls.__mro__:
        if name in vars(klass).get("__annotations__", {}):
            return plain(_own_docs(klass).get(name, ""))
    return ""


def class_doc(cls: type) -> str:
    """The first paragraph of a class's docstring, as help."""
    return plain((inspect.getdoc(cls) or "").split("\n\n")[0], escape=False)


def show(value: Any) -> str:
    """A default as the command line writes it."""
    if isinstance(value, (tuple, list)):
        return ",".join(map(show, value))
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise TypeError(f"field {f.name!r} has no default: it cannot be a flag")


def _unwrap_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(rest) == 1:
            return rest[0]
    return tp


def _empty_is_none(convert: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str):
        return None if text == "" else convert(text)

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


# ------------------------------------------------------------------------------------------ config flags


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _in_bounds(convert: Callable[[str], Any], bounds: Bounds, name: str) -> Callable[[str], Any]:
    """argparse type: ``convert`` then refuse values outside ``bounds`` with the config's own message (naming field
    ``name``)."""
    bounds = dataclasses.replace(bounds, integer=False)  # argparse's int() made it one

    def parse(text: str):
        value = convert(text)
        why = bounds.error(value)
        if why is not None:
            raise argparse.ArgumentTypeError(f"{name} {why}")
        return value

    parse.__name__ = getattr(convert, "__name__", "value")
    return parse


def _nested_config(tp: Any) -> type | None:
    inner = _unwrap_optional(tp)
    return inner if isinstance(inner, type) and dataclasses.is_dataclass(inner) else None


@dataclass(frozen=True)
class ConfigFlags:
    """The flags of a config dataclass, one per field (types, defaults and help texts from the dataclass).

    Types: ``int``, ``float``, ``str``, ``bool`` (default off: ``--flag``; default on: ``--flag/--no-flag``),
    ``X | None`` (an empty string gives None for a text field), tuples or lists of ``int``/``float``/``str``
    (comma lists), and configs (dataclasses): their fields become flags of their own, named as if they were the
    outer config's, and :meth:`values` builds the inner config from them. A field's range and choices
    (:mod:`adaptree.core.config` metadata) make the flag refuse what the config refuses.
    """

    config: type
    prefix: str = ""
    """Flag names are ``--<prefix>-<field>`` (dashes for underscores)."""
    only: tuple[str, ...] | None = None
    """The fields that become flags, in this order (default: every field not excluded, in the config's order)."""
    exclude: tuple[str, ...] = ()
    rename: Mapping[str, str] = field(default_factory=dict)
    """Field -> flag name (without dashes) where the flag is not called after its field."""
    short: Mapping[str, str] = field(default_factory=dict)
    """Field -> short option (``-W``)."""
    choices: Mapping[str, Sequence[str]] = field(default_factory=dict)
    """Fields whose flag takes fewer values than the config does (argparse refuses others)."""
    types: Mapping[str, Callable[[str], Any]] = field(default_factory=dict)
    """Field -> argparse type, where the field's own type does not say how to read it."""
    defaults: Mapping[str, Any] = field(default_factory=dict)
    """Field -> the flag's default where it is not the field's (a command that fills it in itself)."""
    help: Mapping[str, str] = field(default_factory=dict)
    """Field -> help text where the flag reads differently from the field (a renamed or retyped flag)."""
    unset: bool = False
    """Every flag defaults to None and :meth:`values` leaves out the flags not given (the config's defaults
    apply): for flags that several configs share. Their ranges are left to the config a value ends up in (a method's
    flags: the controller built for a method refuses it, one line naming the field, exit status 2)."""
    base: Any = None
    """An instance of :attr:`config` whose values are the defaults (a nested config's: the outer field's default);
    None: the fields' own defaults."""

    def fields(self) -> list[dataclasses.Field]:
        all_fields = {f.name: f for f in dataclasses.fields(self.config)}
        names = self.only if self.only is not None else [n for n in all_fields if n not in self.exclude]
        return [all_fields[n] for n in names]

    def flag(self, name: str) -> str:
        return self.rename.get(name) or "-".join(filter(None, (self.prefix, name))).replace("_", "-")

    def dest(self, name: str) -> str:
        return self.flag(name).replace("-", "_")

    def dests(self) -> dict[str, str]:
        """Field -> argparse destination (a nested config's fields under their own names)."""
        out = {}
        for f in self.fields():
            inner = self.nested(f)
            out.update(inner.dests() if inner is not None else {f.name: self.dest(f.name)})
        return out

    def nested(self, f: dataclasses.Field) -> ConfigFlags | None:
        """The flags of field ``f``'s config when it is one (a dataclass), else None."""
        inner = _nested_config(_hints(self.config)[f.name])
        if inner is None:
            return None
        return ConfigFlags(inner, prefix=self.prefix, rename=self.rename, short=self.short, choices=self.choices,
                           types=self.types, defaults=self.defaults, unset=self.unset, base=self._default(f),
                           help={**f.metadata.get(FLAG_HELP, {}), **self.help})

    def _default(self, f: dataclasses.Field) -> Any:
        return getattr(self.base, f.name) if self.base is not None else _default(f)

    def add(self, parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
        hints = _hints(self.config)
        for f in self.fields():
            inner = self.nested(f)
            if inner is not None:
                inner.add(parser)
            else:
                parser.add_argument(*self._names(f.name), **self.argument(f, hints[f.name]))

    def _names(self, name: str) -> list[str]:
        return [f"--{self.flag(name)}", *([self.short[name]] if name in self.short else [])]

    def argument(self, f: dataclasses.Field, tp: Any) -> dict[str, Any]:
        """The ``add_argument`` keywords of field ``f`` of type ``tp``."""
        value = self.defaults.get(f.name, self._default(f))
        shown = self._default(f) if self.unset else value
        inner = _unwrap_optional(tp)
        optional_text = inner is str and inner is not tp  # '' gives None
        bounds = None if self.unset else bounds_of(f)
        choices = self.choices.get(f.name, choices_of(f))
        kw: dict[str, Any] = {"dest": self.dest(f.name), "default": None if self.unset else value}
        if f.name in self.types:
            kw["type"] = self.types[f.name]
        elif inner is bool:
            kw["action"] = argparse.BooleanOptionalAction if shown else "store_true"
        elif typing.get_origin(inner) in (tuple, list) and typing.get_args(inner)[0] in (int, float, str):
            item = typing.get_args(inner)[0]
            convert = _in_bounds(item, bounds, f.name) if bounds is not None else item
            kw["type"] = comma_type(convert, typing.get_origin(inner), allow_empty=item is str)
            choices = None  # a comma list is no single choice
        elif inner in (int, float, str):
            convert = _empty_is_none(str) if optional_text else inner
            kw["type"] = _in_bounds(inner, bounds, f.name) if bounds is not None and inner is not str else convert
        else:
            raise TypeError(f"{self.config.__name__}.{f.name}: no flag type for {tp}; give one in types=")
        if choices is not None:
            kw["choices"] = list(choices)
        elif inner is not bool:  # --deagle-tau-s TAU_S
            kw["metavar"] = self.flag(f.name).removeprefix(f"{self.prefix}-").upper().replace("-", "_")
        text = self.help.get(f.name) or field_doc(self.config, f.name)
        if shown is not None and shown is not False and kw.get("action") is not argparse.BooleanOptionalAction:
            text = f"{text} (default {show(shown)}{'; empty = unset' if optional_text else ''})".lstrip()
        kw["help"] = text or None
        return kw

    def values(self, args: argparse.Namespace) -> dict[str, Any]:
        """Field -> the value given on the command line (with :attr:`unset`: only the flags given); a nested
        config's field -> that config, of its flags on top of its default."""
        out = {}
        for f in self.fields():
            inner = self.nested(f)
            if inner is None:
                out[f.name] = getattr(args, self.dest(f.name))
                continue
            given = inner.values(args)
            out[f.name] = dataclasses.replace(inner.base, **given) if given or not self.unset else None
        return {k: v for k, v in out.items() if v is not None} if self.unset else out

    def build(self, args: argparse.Namespace, **overrides: Any):
        """The config of the command line's values, ``overrides`` on top."""
        return self.config(**{**self.values(args), **overrides})


# ------------------------------------------------------------------------------------------- method flags

SHAPE_FLAGS = {"width": "-W", "depth": "-D", "size": "-V"}
"""The tree shape (:class:`~adaptree.core.controller.TreeShape`): one ``--width/-W``, ``--depth/-D``, ``--size/-V``
for every method whose config has it; a method keeps its own default when the flag is not given."""

FLAG_PREFIX = {"ltd-depth": "ltd", "ltd-size": "ltd"}
"""Methods whose flags are another method's (LTD's ablations take LTD's policy flags)."""

FLAG_NAMES = {("static-gs", "tuned"): "tuned"}
"""(method, field) -> flag name where it is not ``<method>-<field>``."""

NOT_FLAGS = ("mode",)
"""Config fields the method's name decides."""


@functools.cache
def method_flags() -> dict[str, ConfigFlags]:
    """Method name -> the flags of its config's own fields (not the shape's), all unset by default."""
    from adaptree.core.controller import TreeShape
    from adaptree.methods import REGISTRY

    shape = {f.name for f in dataclasses.fields(TreeShape)}
    out = {}
    for name, m in REGISTRY.items():
        if m.config is None:
            continue
        prefix = FLAG_PREFIX.get(name, name)
        siblings = [s for s, p in FLAG_PREFIX.items() if p == prefix] + [prefix]
        others = {a.option for s in siblings for a in REGISTRY[s].assets} - {a.option for a in m.assets}
        own = tuple(f.name for f in dataclasses.fields(m.config)
                    if f.name not in shape and f.name not in NOT_FLAGS and f.name not in others)
        out[name] = ConfigFlags(m.config, prefix=prefix, only=own, unset=True,
                                rename={f: n for (meth, f), n in FLAG_NAMES.items() if meth == name})
    return out


def _shape_help(name: str) -> str:
    from adaptree.core.controller import TreeShape
    from adaptree.methods import REGISTRY

    by_default: dict[str, list[str]] = {}
    for method, m in REGISTRY.items():
        if m.config is not None and name in {f.name for f in dataclasses.fields(m.config)}:
            value = next(f for f in dataclasses.fields(m.config) if f.name == name).default
            by_default.setdefault("unset (the method decides)" if value is None else show(value), []).append(method)
    if len(by_default) == 1:
        return f"{field_doc(TreeShape, name)} (default {next(iter(by_default))})"
    defaults = "; ".join(f"{d} for {', '.join(ms)}" for d, ms in by_default.items())
    return f"{field_doc(TreeShape, name)} (default {defaults})"


def add_method_args(p: argparse.ArgumentParser) -> None:
    """``--method`` and every method's flags, generated from the method registry (one section per method)."""
    from adaptree.methods import METHODS, REGISTRY

    p.add_argument("--method", choices=METHODS, default=None,
                   help="the controller deciding each cycle's tree (default: the method that models fastest on this "
                        "machine, see `adaptree adapt`; ar without a head or a machine setup); each method's "
                        "settings are in its section below")
    tree = p.add_argument_group("tree shape", "W, depth and V of every method with a tree (not static-gs, resps)")
    for name, short in SHAPE_FLAGS.items():
        tree.add_argument(f"--{name}", short, type=int, default=None, help=_shape_help(name))
    seen: set[str] = set()
    for name, flags in method_flags().items():
        fresh = [f for f in flags.only or () if flags.flag(f) not in seen]
        if not fresh:
            continue
        seen.update(flags.flag(f) for f in fresh)
        group = p.add_argument_group(FLAG_PREFIX.get(name, name), class_doc(REGISTRY[name].config))
        dataclasses.replace(flags, only=tuple(fresh)).add(group)


def method_options(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """The config fields of ``method`` given on the command line; fields not given keep the method's defaults
    (depth 8 for static, 12 for deagle, ...). A name that is no method (a bench's Hugging Face arm) has none."""
    from adaptree.methods import REGISTRY

    m = REGISTRY.get(method)
    if m is None or m.config is None:
        return {}
    names = {f.name for f in dataclasses.fields(m.config)}
    opts = {f: getattr(args, f) for f in SHAPE_FLAGS if f in names and getattr(args, f, None) is not None}
    opts.update(method_flags()[method].values(args))
    return opts


def build_controller(args: argparse.Namespace, head=None, tokenizer=None):
    """The controller of ``args.method`` without a pipeline (``simulate``; default: static with a draft head, else
    ar) with its flags; learned methods' policies and static-gs's tree come from next to the head in use
    (``args.draft_path``)."""
    from adaptree.methods import make_controller

    method = args.method or ("static" if head is not None else "ar")
    return make_controller(method, head_folder=getattr(args, "draft_path", None), model=getattr(args, "model", None),
                           tokenizer=tokenizer, **method_options(args, method))


# -------------------------------------------------------------------------------------------- model flags


def add_model_args(p: argparse.ArgumentParser, dtype: str = "auto", why: str = "", adapt: bool = True) -> None:
    """``--model``, ``--draft``, ``--dtype`` (default ``dtype``, ``why`` it is that here), ``--weights``, ``--compile``,
    ``--device``, ``--threads``, ``--max-seq-len`` and (``adapt``) ``--adapt/--no-adapt``: what :func:`load_pipeline`
    reads. Commands that measure or train on purpose take ``adapt=False`` and an explicit dtype."""
    from adaptree.adapt.execution import DTYPES, WEIGHTS
    from adaptree.models import DEFAULT_MODEL_NAME, MODELS

    names = ", ".join(MODELS)
    g = p.add_argument_group("model")
    g.add_argument("--model", default=None,
                   help=f"a model name ({names}), a Hugging Face checkpoint folder or a .gguf file "
                        f"(default: {DEFAULT_MODEL_NAME}, the embedded SmolLM2-135M-Instruct); GGUF models are "
                        "converted once to a float cache under $ADAPTREE_CACHE (default ~/.cache/adaptree)")
    g.add_argument("--draft", default="auto",
                   help="EAGLE-3 draft head folder (config.json + model.safetensors); 'auto' (default) = the head "
                        "adaptree ships for a registered model, 'none' = no head")
    g.add_argument("--draft-model", default=None,
                   help="a smaller model with the target's tokenizer for the draft-model method (a model name, folder "
                        "or .gguf, as --model), loaded in the target's dtype and weights; auto = the registered "
                        "smaller sibling (qwen2.5-coder-0.5b for qwen2.5-coder-1.5b); default: none")
    g.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default=dtype,
                   help=f"weights and activations; auto = the one this machine runs fastest (measured once, cached), "
                        f"float32 for bit-exact lossless greedy output (default {dtype}{why})")
    g.add_argument("--weights", choices=["auto", *WEIGHTS], default="auto" if dtype == "auto" else "float",
                   help="float = dequantised to --dtype; int4 = the GGUF file's own 4-bit blocks run by PyTorch's "
                        "int4 CPU kernel (docs/performance.md); ggml = the GGUF file on llama.cpp's kernels, --dtype "
                        "then the draft head's (docs/ggml.md; needs llama-cpp-python, else the float weights run); "
                        "auto = chosen with the dtype by measurement "
                        f"(default {'auto' if dtype == 'auto' else 'float'})")
    g.add_argument("--compile", choices=["auto", "on", "off"], default="auto",
                   help="run decode steps and small trees through torch.compile: auto = up to the tree size where it "
                        "measured faster on this machine (measured once with the machine setup, cached; costs seconds "
                        "per process on the first generation), on, off (default auto)")
    g.add_argument("--device", type=device_type, default="cpu",
                   help="where the target and the head run: cpu (default), cuda or cuda:N; the machine setup is kept "
                        "per device")
    g.add_argument("--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--max-seq-len", type=positive_int, default=None,
                   help="context limit (default: the model's, <= 8192)")
    if adapt:
        g.add_argument("--adapt", action=argparse.BooleanOptionalAction, default=None,
                       help="measure this machine on first use (latency, dtype, tree, default method; about 2 "
                            "minutes, cached; default: yes unless ADAPTREE_ADAPT=0); --no-adapt still uses a cached "
                            "setup")


def load_pipeline(args: argparse.Namespace):
    """The :class:`~adaptree.api.Pipeline` of the model flags; ``args.draft_path`` is set to the head folder in
    use (the method flags find policies next to it)."""
    from adaptree.api import load

    p = load(args.model, head=getattr(args, "draft", "none"), dtype=args.dtype, weights=args.weights,
             compile=args.compile, device=args.device, threads=args.threads,
             max_seq_len=args.max_seq_len, adapt=getattr(args, "adapt", False),
             progress=not getattr(args, "quiet", False), draft_model=getattr(args, "draft_model", None))
    args.draft_path = str(p.head_folder) if p.head_folder else None
    return p


def pipeline_controller(args: argparse.Namespace, pipeline):
    """The controller of the method flags for ``pipeline`` (:meth:`~adaptree.api.Pipeline.controller`)."""
    return pipeline.controller(args.method, **method_options(args, args.method or pipeline.default_method))


# --------------------------------------------------------------------------------------- other shared flags


def add_prompt_args(p: argparse.ArgumentParser, limit: int, what: str) -> None:
    """``--datasets``, ``--question-file``, ``--limit``: the prompts of :func:`~adaptree.data.prompts.load_prompt_sets`."""
    p.add_argument("--datasets", type=comma_type(str, allow_empty=True), default=("mt_bench", "humaneval"),
                   help=f"{what}: comma-separated mt_bench, humaneval, sharegpt (first user turns; default "
                        "mt_bench,humaneval)")
    p.add_argument("--question-file", default=None, help="an EAGLE-format question.jsonl, used too")
    p.add_argument("--limit", type=positive_int, default=limit, help=f"prompts per dataset (default {limit})")


def prompt_sets(args: argparse.Namespace):
    from adaptree.data.prompts import load_prompt_sets

    return load_prompt_sets(args.datasets, args.question_file, args.limit)


def add_chat_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="apply the model's chat template (default: when the model has one)")


def add_output_args(p: argparse.ArgumentParser, json_help: str | None = None, quiet: bool = True) -> None:
    """``--json`` (when ``json_help``) and ``--quiet``."""
    if json_help:
        p.add_argument("--json", action="store_true", help=json_help)
    if quiet:
        p.add_argument("--quiet", action="store_true", help="no progress bars")


def command_line() -> str:
    """The command as typed, recorded with results."""
    import sys

    return "adaptree " + " ".join(sys.argv[1:])
