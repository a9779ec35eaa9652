"""What a config node's ``_target_`` accepts, read from its constructor: the one source of each key's default, type,
range and doc.

A configurable class says everything about a setting in its ``__init__`` signature::

    def __init__(self, d_model: int, n_heads: int,
                 base: Annotated[float, Gt(1)] = 10000.0,
                 max_len: Annotated[int, Interval(ge=1, le=MAX_LEN), "rows of the learned table"] = 512): ...

- the default is the config's default (``configs/`` yaml files keep only ``_target_`` and interpolations; Hydra gets
  the rest from here, see ``hydra_plugins.pe_geometry.defaults``);
- the type and the ``annotated_types`` constraints are what ``training.schema`` checks a value against, and they word
  its error (``pe.base=0.5 must be a number > 1``);
- a string in the ``Annotated`` metadata is the doc: one starting with "a "/"an " names the value (``"a probability"``
  reads ``a probability in [0, 1)``), any other is added in brackets.

``constructor_params`` reads the signature from the source file without importing it (``ast``), so that a wrong value
is answered before torch and Lightning load (seconds); whatever cannot be read so is read by importing the class.
``tests/test_signatures.py`` holds the two readings equal for every class the configs name. This module imports only the
standard library and ``annotated_types``, which the evaluated annotations need.
"""

from __future__ import annotations

import ast
import builtins
import collections.abc
import dataclasses
import importlib
import importlib.util
import inspect
import math
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import annotated_types

EMPTY = inspect.Parameter.empty  # no default (required), or no annotation (any value)
MAX_SEED = 2**32 - 1  # numpy's seed range, which seed_everything enforces: the range of every seed setting


@dataclass(frozen=True)
class Param:
    """One keyword a constructor accepts: its evaluated annotation (``EMPTY``: any value) and default (``EMPTY``:
    required)."""

    name: str
    annotation: Any = EMPTY
    default: Any = EMPTY
    owner: str = dataclasses.field(default="", compare=False)  # the module that declares it


class Unreadable(Exception):
    """The source does not say it plainly enough (a name defined at run time, a base class of another library)."""


# -- reading by import ------------------------------------------------------------------------------------------------
def import_target(target: str) -> Any:
    """``a.b.C`` -> the object (the longest importable module prefix, then attributes), quietly: Hydra's ``get_class``
    logs a multi-line error of its own before raising."""
    parts = target.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as err:
            if err.name is not None and not ".".join(parts[:cut]).startswith(err.name):
                raise  # the module exists and imports something missing: say that, not "no module"
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        if cut == len(parts) or not callable(obj):
            raise ImportError(f"{target} is not a class or a function")
        return obj
    raise ImportError(f"no module named {parts[0]!r}")


def _hints(function: Any) -> dict[str, Any]:
    try:
        return typing.get_type_hints(function, include_extras=True)
    except Exception:  # noqa: BLE001 - an annotation that does not evaluate: its parameters take any value
        return {}


def imported_params(target: str) -> dict[str, Param] | None:
    """The keywords ``target(...)`` accepts, by importing it: ``**kwargs`` is followed up the class hierarchy, or into
    the dataclass a class names as what its ``**kwargs`` build (``config_type``); None when the chain ends in a
    catch-all ``**kwargs`` (any key may be meant)."""
    obj = import_target(target)
    if not isinstance(obj, type):
        own, takes_kwargs = _function_params(obj, skip_self=False)
        return None if takes_kwargs else own
    out: dict[str, Param] = {}
    for klass in obj.__mro__[:-1]:  # (not object)
        if "__init__" not in vars(klass):
            continue
        own, takes_kwargs = _function_params(vars(klass)["__init__"], skip_self=True)
        out = {**own, **out}  # a base's keywords first, as the source reading orders them
        if not takes_kwargs:
            return out
        config_type = getattr(obj, "config_type", None)
        if dataclasses.is_dataclass(config_type):
            return {**_dataclass_params(config_type), **out}
    return None


def _function_params(function: Any, skip_self: bool) -> tuple[dict[str, Param], bool]:
    """A function's keyword parameters and whether it takes ``**kwargs``."""
    params = list(inspect.signature(function).parameters.values())[1 if skip_self else 0:]
    hints = _hints(function)
    own = {p.name: Param(p.name, hints.get(p.name, EMPTY), p.default, function.__module__)
           for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}
    return own, any(p.kind is p.VAR_KEYWORD for p in params)


def _dataclass_params(cls: type) -> dict[str, Param]:
    hints = _hints(cls)
    return {f.name: Param(f.name, hints.get(f.name, EMPTY), f.default) for f in dataclasses.fields(cls)}


# -- reading the source -----------------------------------------------------------------------------------------------
@cache
def _module_file(module: str) -> Path:
    """The source file of ``module`` without importing it (``find_spec`` of a top-level name runs no code)."""
    top, *rest = module.split(".")
    spec = importlib.util.find_spec(top)
    if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
        raise Unreadable(module)
    path = Path(spec.origin)
    for part in rest:
        if path.name != "__init__.py":
            raise Unreadable(module)
        package = path.parent / part / "__init__.py"
        path = package if package.is_file() else path.parent / f"{part}.py"
        if not path.is_file():
            raise Unreadable(module)
    return path


@dataclass
class _Module:
    name: str
    package: str
    tree: ast.Module
    names: dict[str, Any]  # what an annotation or a default may use: typing, annotated_types, literal constants
    imported: dict[str, tuple[str, str]]  # name -> (module, its name there): constants of sibling modules, read when used

    def resolve(self, node: ast.expr) -> dict[str, Any]:
        """``names``, with the sibling-module constants ``node`` uses read in (lazily: a module names many)."""
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name) and sub.id not in self.names and sub.id in self.imported:
                module, original = self.imported[sub.id]
                try:
                    found = _parse(module)
                    if original not in found.names and original in found.imported:
                        found.resolve(ast.Name(original))
                except (Unreadable, SyntaxError, OSError, RecursionError):
                    continue
                if original in found.names:
                    self.names[sub.id] = found.names[original]
        return self.names


@cache
def _parse(module: str) -> _Module:
    path = _module_file(module)
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names: dict[str, Any] = {}
    imported: dict[str, tuple[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module in _KNOWN_MODULES and node.level == 0:
            source = _KNOWN_MODULES[node.module]
            names |= {a.asname or a.name: getattr(source, a.name) for a in node.names if hasattr(source, a.name)}
        elif isinstance(node, ast.ImportFrom):  # a constant of a sibling module (MAX_SEED): only within this package
            other = _absolute(_Module(module, package, tree, {}, {}), node)
            if other.split(".")[0] == module.split(".")[0] and other != module:
                imported |= {a.asname or a.name: (other, a.name) for a in node.names}
        elif isinstance(node, ast.Import):
            names |= {a.asname or a.name: _KNOWN_MODULES[a.name] for a in node.names if a.name in _KNOWN_MODULES}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            try:
                value = _evaluate(node.value, names)
            except Unreadable:
                continue
            names |= {t.id: value for t in targets if isinstance(t, ast.Name)}
    return _Module(module, package, tree, names, imported)


_KNOWN_MODULES = {"typing": typing, "annotated_types": annotated_types, "collections.abc": collections.abc, "math": math}


def _evaluate(node: ast.expr, names: dict[str, Any]) -> Any:
    """A literal, or an expression of the names a module imported from typing/annotated_types and its constants."""
    try:
        return ast.literal_eval(node)
    except (ValueError, SyntaxError, TypeError):
        pass
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id not in names and not hasattr(builtins, sub.id):
            raise Unreadable(sub.id)
        if isinstance(sub, (ast.Call, ast.Lambda, ast.NamedExpr)) and not _constraint_call(sub, names):
            raise Unreadable(ast.unparse(sub))
    try:
        return eval(compile(ast.Expression(node), "<signature>", "eval"), {"__builtins__": builtins}, dict(names))  # noqa: S307
    except Exception as err:  # noqa: BLE001
        raise Unreadable(ast.unparse(node)) from err


def _constraint_call(node: ast.AST, names: dict[str, Any]) -> bool:
    """``Interval(ge=1, le=N)``: a call of an annotated_types constraint, the one call an annotation may hold."""
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and getattr(names.get(node.func.id), "__module__", "") == "annotated_types")


def _find(module: str, name: str, depth: int = 0) -> tuple[_Module, ast.ClassDef | ast.FunctionDef]:
    """The definition ``name`` of ``module``, following ``from x import name`` re-exports."""
    if depth > 8:
        raise Unreadable(f"{module}.{name}")
    parsed = _parse(module)
    for node in parsed.tree.body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)) and node.name == name:
            return parsed, node
    for node in parsed.tree.body:
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    return _find(_absolute(parsed, node), alias.name, depth + 1)
    raise Unreadable(f"{module}.{name}")


def _absolute(parsed: _Module, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = parsed.package.split(".")
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _arguments(parsed: _Module, function: ast.FunctionDef, skip_self: bool) -> tuple[dict[str, Param], bool]:
    """The function's keyword parameters and whether it takes ``**kwargs``."""
    args = function.args
    positional = args.posonlyargs + args.args
    defaults = [EMPTY] * (len(positional) - len(args.defaults)) + list(args.defaults)
    pairs = list(zip(positional, defaults)) + list(zip(args.kwonlyargs, args.kw_defaults))
    out = {}
    for arg, default in pairs[1 if skip_self else 0:]:
        out[arg.arg] = Param(arg.arg, _lenient(arg.annotation, parsed), _lenient(default, parsed), parsed.name)
    return out, args.kwarg is not None


def _lenient(node: ast.expr | None, parsed: _Module) -> Any:
    """An annotation or a default, or ``EMPTY`` where it names what only running the module defines (a factory type,
    a torch default): such a key takes any value here, and its check waits for the import."""
    if node is None or node is EMPTY:
        return EMPTY
    try:
        return _evaluate(node, parsed.resolve(node))
    except Unreadable:
        return EMPTY


def _class_params(parsed: _Module, node: ast.ClassDef, depth: int = 0) -> dict[str, Param] | None:
    if depth > 8:
        raise Unreadable(node.name)
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is not None:
        own, takes_kwargs = _arguments(parsed, init, skip_self=True)
        if not takes_kwargs:
            return own
        config_type = _class_attribute(parsed, node, "config_type")
        if config_type is not None:
            return {**_dataclass_fields(*config_type), **own}
    else:
        own = {}
    if len(node.bases) != 1 or not isinstance(node.bases[0], ast.Name):
        raise Unreadable(node.name)  # a base of another library (nn.Module, L.Callback): read by import
    base_module, base = _find(parsed.name, node.bases[0].id)
    if not isinstance(base, ast.ClassDef):
        raise Unreadable(node.bases[0].id)
    inherited = _class_params(base_module, base, depth + 1)
    return None if inherited is None else {**inherited, **own}


def _dataclass_fields(parsed: _Module, node: ast.ClassDef | ast.FunctionDef) -> dict[str, Param]:
    if not isinstance(node, ast.ClassDef):
        raise Unreadable(node.name)
    out = {}
    for item in node.body:
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            if "ClassVar" in ast.unparse(item.annotation):
                continue
            out[item.target.id] = Param(item.target.id, _lenient(item.annotation, parsed), _lenient(item.value, parsed),
                                        parsed.name)
    return out


def _class_attribute(parsed: _Module, node: ast.ClassDef, name: str, depth: int = 0):
    """The definition a class attribute ``name = SomeClass`` names, looked up the class's bases of this source."""
    for item in node.body:
        targets = item.targets if isinstance(item, ast.Assign) else [item.target] if isinstance(item, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and isinstance(item.value, ast.Name):
            return _find(parsed.name, item.value.id)
    for base in node.bases:
        if isinstance(base, ast.Name) and depth < 8:
            try:
                base_module, base_node = _find(parsed.name, base.id)
            except Unreadable:
                continue
            if isinstance(base_node, ast.ClassDef):
                found = _class_attribute(base_module, base_node, name, depth + 1)
                if found is not None:
                    return found
    return None


def source_params(target: str) -> dict[str, Param] | None:
    """``imported_params`` read from the source files, without importing them; ``Unreadable`` where they do not say."""
    found = _source_params(target)
    if isinstance(found, Unreadable):  # a fresh one each time (a raised instance would grow its traceback)
        raise Unreadable(*found.args) from found.__cause__
    return None if found is None else dict(found)


@cache  # as _parse: once per process (a check reads the same few constructors for every node of every config)
def _source_params(target: str) -> dict[str, Param] | None | Unreadable:
    module, _, name = target.rpartition(".")
    try:
        parsed, node = _find(module, name)
        if isinstance(node, ast.FunctionDef):
            own, takes_kwargs = _arguments(parsed, node, skip_self=False)
            return None if takes_kwargs else own
        return _class_params(parsed, node)
    except (SyntaxError, OSError, UnicodeDecodeError) as err:
        unreadable = Unreadable(target)
        unreadable.__cause__ = err
        return unreadable
    except Unreadable as unreadable:
        return unreadable


def constructor_params(target: str, import_if_needed: bool = True) -> dict[str, Param] | None:
    """The keywords ``target(...)`` accepts (None: any). From the source when it says them plainly, else by import
    (``import_if_needed=False``: raise ``Unreadable`` instead, for a check that must not load torch)."""
    try:
        return source_params(target)
    except Unreadable:
        if not import_if_needed:
            raise
    return imported_params(target)


# -- wording ----------------------------------------------------------------------------------------------------------
def describe(annotation: Any) -> str:
    """What a value of this annotation must be, as an error line ends: ``an integer >= 2``, ``one of ['pre', 'post']``,
    ``a positive integer, or null``; a doc starting with "null" says what null means (``or null for 4 * d_model``)."""
    base, metadata = annotation, []
    if typing.get_origin(annotation) is typing.Annotated:
        base, *metadata = typing.get_args(annotation)
    docs = [m for m in metadata if isinstance(m, str)]
    noun = next((d for d in docs if d.startswith(("a ", "an "))), None)
    null = next((d for d in docs if d.startswith("null")), "null")
    notes = "".join(f" ({d})" for d in docs if d is not noun and not d.startswith("null"))
    args = typing.get_args(base)
    if typing.get_origin(base) in (typing.Union, _UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        inner = rest[0] if len(rest) == 1 else typing.Union[tuple(rest)]  # noqa: UP007
        if typing.get_origin(inner) is typing.Annotated:  # Annotated[int, Ge(1)] | None
            inner, *more = typing.get_args(inner)
            metadata = metadata + more
        return f"{_describe_base(inner, _bounds(metadata), noun)}{notes}, or {null}"
    return f"{_describe_base(base, _bounds(metadata), noun)}{notes}"


_UnionType = type(int | None)


def _bounds(metadata: list) -> dict[str, Any]:
    bounds: dict[str, Any] = {}
    for item in metadata:
        if isinstance(item, annotated_types.Interval):
            bounds |= {k: getattr(item, k) for k in ("gt", "ge", "lt", "le") if getattr(item, k) is not None}
        elif isinstance(item, (annotated_types.Gt, annotated_types.Ge, annotated_types.Lt, annotated_types.Le)):
            key = type(item).__name__.lower()
            bounds[key] = getattr(item, key)
        elif isinstance(item, annotated_types.MinLen):
            bounds["min_length"] = item.min_length
    return bounds


def _describe_base(base: Any, bounds: dict[str, Any], noun: str | None) -> str:
    origin = typing.get_origin(base)
    if origin is typing.Literal:
        return f"one of {list(typing.get_args(base))}"
    if base is bool:
        return "true or false"
    if origin in (list, tuple, collections.abc.Sequence):
        item = typing.get_args(base)[0] if typing.get_args(base) else Any
        kind = "a non-empty list" if bounds.get("min_length") else "a list"
        if typing.get_origin(item) is typing.Literal:
            return noun or f"{kind} of {list(typing.get_args(item))}"
        return noun or (f"{kind} of {_plural(item)}" if item is not Any else kind)
    if base is str:
        return noun or "a string"
    if base in (int, float):
        low = ("(", bounds["gt"]) if "gt" in bounds else ("[", bounds["ge"]) if "ge" in bounds else None
        high = (")", bounds["lt"]) if "lt" in bounds else ("]", bounds["le"]) if "le" in bounds else None
        if noun and "positive" in noun and low in (("[", 1), ("(", 0)):
            low = None  # "a positive number of characters" says it already
        fraction = base is float and low is not None and high is not None and low[1] >= 0 and high[1] <= 1
        word = noun or ("an integer" if base is int else "a fraction" if fraction else "a number")
        if base is int and low == ("[", 1) and high is None and noun is None:
            return "a positive integer"
        if low and high:
            return f"{word} in {low[0]}{low[1]}, {high[1]}{high[0]}"
        if low:
            return f"{word} {'>' if low[0] == '(' else '>='} {low[1]}"
        if high:
            return f"{word} {'<' if high[0] == ')' else '<='} {high[1]}"
        return word
    if typing.get_origin(base) in (typing.Union, _UnionType):
        return noun or " or ".join(_describe_base(a, bounds, None) for a in typing.get_args(base))
    return noun or "a valid value"


def _plural(item: Any) -> str:
    return {str: "strings", int: "integers", float: "numbers"}.get(item, "values")
