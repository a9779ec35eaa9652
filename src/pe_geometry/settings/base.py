"""The machinery every component's settings share: validation, the registry, and Hydra's view of them.

A component (a positional encoding, an attention, a model, a data module, ...) says everything about its settings in
one dataclass deriving ``Settings``::

    @component("pe_geometry.model.RotaryPE")
    @dataclass(frozen=True)
    class RotarySettings(EncodingSettings):
        base: Annotated[float, Gt(1)] = 10000.0          # default, type and range
        max_len: Annotated[int, Ge(1), "rows of the table"] = 512   # a string in the metadata is the doc

        def check(self, sizes: Sizes) -> None:            # what needs more than one key, or the model's sizes
            ...

- building one checks every field's type and range (``RotarySettings(base=0.5)``: ``pe.base=0.5 must be a number
  > 1``), so the class built from it (``RotaryPE(d_model, n_heads, **settings)``) never re-checks a range;
- ``component`` registers it for the class it configures (``REGISTRY``): the config schema (``training.schema``)
  finds it by the node's ``_target_`` without importing the class (``registry.settings_of``; this package imports no
  torch, so a bad value is answered before torch loads), and ``registry.store_in_hydra`` hands every registered
  dataclass's defaults to Hydra's ``ConfigStore`` as ``settings/<Dataclass>``, which a group's yaml extends
  (``defaults: [/settings/RotarySettings@_here_, _self_]``);
- a package outside this one registers its own the same way, from a module named in its ``pe_geometry.settings``
  entry point (``registry.load_plugins``), and is then first-class: bare overrides, ``--cfg job``, every default
  stored.

A string in the ``Annotated`` metadata words the errors: one starting with "a "/"an " names the value (``"a
probability"`` reads ``a probability in [0, 1)``), one starting with "null" says what null means, any other is added
in brackets (``describe``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import typing
from dataclasses import dataclass
from types import UnionType
from typing import Annotated, Any, ClassVar, Union, get_args, get_origin

from pydantic import AllowInfNan, BaseModel, BeforeValidator, ConfigDict, Strict, ValidationError, create_model

from pe_geometry.settings.wording import describe

MAX_SEED = 2**32 - 1  # numpy's seed range, which seed_everything enforces: the range of every seed setting


class SettingsError(ValueError):
    """A settings value that cannot work: one line naming each bad key, its value and what would be valid."""


@dataclass(frozen=True)
class Sizes:
    """The model's sizes a component's cross-key checks read: width, heads, and the length it trains at (0 where the
    length is not known yet: the check of a class being built)."""

    d_model: int
    n_heads: int
    seq_len: int = 0

    @property
    def d_head(self) -> int:
        return self.d_model // self.n_heads


@dataclass(frozen=True)
class Settings:
    """Base of every component's settings. ``group`` is the config key its errors name (``pe.base=...``)."""

    group: ClassVar[str] = ""
    target: ClassVar[str] = ""  # the class these settings configure (set by ``component``)

    def __post_init__(self) -> None:
        problems, coerced = field_problems(type(self), {f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
                                           self.group)
        if problems:
            raise SettingsError("; ".join(dict.fromkeys(line for _, line in problems)))  # one line per problem
        for name, value in coerced.items():
            object.__setattr__(self, name, value)  # '3' -> 3, a tuple from a list: what was checked is what is used

    def check(self, sizes: Sizes) -> None:
        """Raise ``SettingsError`` (one line naming the config keys) where these settings cannot work with the
        model's sizes; the base accepts every size."""

    def warnings(self, sizes: Sizes, precision: str = "32-true") -> list[str]:
        """Lines to warn with (one each) where a setting works but does not fit the run; the base has none."""
        return []

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


# -- the registry -------------------------------------------------------------------------------------------------
REGISTRY: dict[str, type[Settings]] = {}  # _target_ -> its settings


def component(target: str, *also: str) -> Any:
    """Class decorator: register a settings dataclass for the class ``target`` names (``also``: other spellings of
    the same target, a re-export)."""

    def register(cls: type[Settings]) -> type[Settings]:
        for name in (target, *also):
            known = REGISTRY.get(name)
            if known is not None and known.__qualname__ != cls.__qualname__:
                raise ValueError(f"{name} has settings already ({known.__module__}.{known.__qualname__})")
            REGISTRY[name] = cls
        cls.target = target
        return cls

    return register


def defaults(cls: type[Settings]) -> dict[str, Any]:
    """The fields that have a default, as a config holds them (tuples as lists)."""
    out = {}
    for f in dataclasses.fields(cls):
        value = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else dataclasses.MISSING)
        if value is not dataclasses.MISSING:
            out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


# -- validation ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Field:
    """One setting: its annotation (``Any``: any value), its default (``dataclasses.MISSING``: required)."""

    name: str
    annotation: Any
    default: Any


def fields_of(cls: type) -> dict[str, Field]:
    hints = typing.get_type_hints(cls, include_extras=True)
    out = {}
    for f in dataclasses.fields(cls):
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        out[f.name] = Field(f.name, hints.get(f.name, Any), default)
    return out


def as_checked(annotation: Any) -> Any:
    """An annotation as a config value is checked against it: booleans strict (``compile=yes`` is refused, not read
    as true), numbers finite (no setting of ours means inf), and a list given one value is that value's list
    (``train_files=a.txt``)."""
    origin, args = get_origin(annotation), get_args(annotation)
    if annotation is bool:
        return Annotated[bool, Strict()]
    if annotation is float:
        return Annotated[float, AllowInfNan(False)]
    if origin is Annotated:
        return Annotated[(as_checked(args[0]), *args[1:])]
    if origin is list:
        return Annotated[annotation, BeforeValidator(lambda v: [v] if isinstance(v, str) else v)]
    if origin in (Union, UnionType):
        return Union[tuple(as_checked(a) for a in args)]  # noqa: UP007
    if origin is tuple:
        return tuple[tuple(as_checked(a) for a in args)] if args and Ellipsis not in args else annotation
    return annotation


@functools.cache
def _validator(cls: type) -> tuple[type[BaseModel], dict[str, str]]:
    """A pydantic model of the dataclass's fields, and the wording of each (``describe``)."""
    fields = fields_of(cls)
    model = create_model(f"Settings of {cls.__name__}", __config__=ConfigDict(extra="ignore", arbitrary_types_allowed=True),
                         **{f.name: (as_checked(f.annotation), None) for f in fields.values() if f.annotation is not Any})
    return model, {f.name: describe(f.annotation) for f in fields.values() if f.annotation is not Any}


def show(value: Any) -> str:
    """A value as the user would type it on the command line."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, (list, tuple, dict)):
        return json.dumps(value, default=str).replace(" ", "")
    return str(value)


def model_problems(key: str, model: type[BaseModel], values: dict[str, Any],
                   wording: dict[str, str] | None = None) -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Validate ``values`` with a pydantic ``model``: (key, error line) pairs and the coerced values of the keys
    given. ``wording``: what each field must be, where the field's own description does not say it."""
    wording = wording or {}
    try:
        checked = model.model_validate(values)
    except ValidationError as err:
        lines = []
        for problem in err.errors():
            field = str(problem["loc"][0])
            info = model.model_fields.get(field)
            meaning = wording.get(field) or (info.description if info and info.description else problem["msg"])
            full = f"{key}.{field}" if key else field
            if problem["type"] == "extra_forbidden":
                lines.append((full, f"{full} is not a setting of {key or 'the config'}; valid: {sorted(model.model_fields)}"))
            elif problem["type"] == "missing" and field not in values:
                lines.append((full, f"{full} is missing; it must be {meaning}"))
            else:
                lines.append((full, f"{full}={show(values.get(field, problem['input']))} must be {meaning}"))
        return lines, {}
    given = set(values) & set(model.model_fields)
    return [], {k: v for k, v in checked.model_dump().items() if k in given}


def field_problems(cls: type, values: dict[str, Any], key: str = "") -> tuple[list[tuple[str, str]], dict[str, Any]]:
    """Each value of ``values`` against the dataclass field of its name: (key, error line) pairs, and the values
    coerced where checking changed them (``'3'`` -> 3)."""
    model, wording = _validator(cls)
    problems, checked = model_problems(key, model, values, wording)
    return problems, {k: v for k, v in checked.items() if not (v == values[k] and type(v) is type(values[k]))}
