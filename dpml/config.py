"""The one schema for ``params.yaml``, composed from the common sections and the trainers' own.

Every parameter of a run lives in ``params.yaml`` (read by DVC for dependency tracking and by
Prefect / the CLI for execution). It is validated once, here, before any work starts. An invalid
value is rejected with a :class:`ConfigError` that names the key, the value and what is allowed.

Composition: the common sections are in :mod:`dpml.sections` (``data`` in :mod:`dpml.data.schema`); each trainer
(:mod:`dpml.train.registry`) brings its member of the ``train`` union (``train.algorithm`` selects
it) and any section of its own, and its own cross-section rules (:meth:`Trainer.check`). This module
keeps the loader and the rules that belong to no one trainer.

Overrides use dotted keys (``dp.target_epsilon=2``, ``data.columns.age.upper=90``); the value is
parsed as YAML, so numbers, booleans, ``null`` and lists work as they do in the file. The file and
every override are read strictly (:mod:`dpml.params_yaml`): a key given twice at any level is an error
naming both lines, every number must be finite in whatever spelling, and a table's names and
categories keep the text the user wrote (``[no, yes]`` are two strings, not booleans).
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Self, TYPE_CHECKING, Union

import yaml
from pydantic import Field, ValidationError, create_model, field_validator, model_validator

from dpml.data.schema import SKLEARN_BUNDLED, VERBATIM_KEYS, VERBATIM_VALUES, DataConfig
from dpml.data.source_kinds import default_model_name
from dpml.params_yaml import MAX_BYTES, MAX_NODES, YamlError, dotted, load_yaml
from dpml.routing import RoutingError, resolve_tracking
from dpml.sections import (
    BOOLEAN_FOR_NUMBER,
    TUNABLE_KEYS,
    AuditConfig,
    DpConfig,
    GateConfig,
    ModelConfig,
    PreprocessConfig,
    Section,
    SplitConfig,
    TrainSettings,
    TuneConfig,
)
from dpml.sections_stores import LedgerConfig, PathsConfig, TrackingConfig
from dpml.train.registry import TRAINERS, trainer_for

__all__ = [
    "SKLEARN_BUNDLED",
    "TUNABLE_KEYS",
    "AuditConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DpConfig",
    "GateConfig",
    "LedgerConfig",
    "ModelConfig",
    "PathsConfig",
    "PreprocessConfig",
    "SplitConfig",
    "TrackingConfig",
    "TrainSettings",
    "TuneConfig",
    "apply_overrides",
    "check_tunable",
    "load",
    "validate",
    "with_hyperparameters",
]


class ConfigError(ValueError):
    """An invalid configuration: names each offending key, its value and what is allowed."""


class ConfigBase(Section):
    """The common sections and the rules that belong to no one trainer; :func:`compose` adds the
    ``train`` union and the trainers' own sections."""

    data: DataConfig = Field(default_factory=DataConfig)
    split: SplitConfig = Field(default_factory=SplitConfig)
    preprocess: PreprocessConfig = Field(default_factory=PreprocessConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    train: TrainSettings = Field(default_factory=TrainSettings)
    dp: DpConfig = Field(default_factory=DpConfig)
    audit: AuditConfig = Field(default_factory=AuditConfig)
    tune: TuneConfig = Field(default_factory=TuneConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    ledger: LedgerConfig = Field(default_factory=LedgerConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    paths: PathsConfig = Field(default_factory=PathsConfig)
    plugins: list[str] = Field(default_factory=list)

    @field_validator("train", mode="before")
    @classmethod
    def _default_algorithm(cls, value: Any) -> Any:
        """A ``train`` section without ``algorithm`` means DP-SGD, as the schema's default."""
        if isinstance(value, dict) and "algorithm" not in value:
            return {**value, "algorithm": "dpsgd"}
        return value

    @model_validator(mode="before")
    @classmethod
    def _name_the_model(cls, value: Any) -> Any:
        """``tracking.model_name`` left out: ``dpml-<name of data.source>`` (each data set its own model)."""
        if not isinstance(value, dict):
            return value
        tracking, data = value.get("tracking") or {}, value.get("data") or {}
        if isinstance(tracking, dict) and isinstance(data, dict) and tracking.get("model_name") is None:
            source = data.get("source", DataConfig.model_fields["source"].default)
            if isinstance(source, str):
                value = {**value, "tracking": {**tracking, "model_name": default_model_name(source)}}
        return value

    @model_validator(mode="after")
    def _cross_section_rules(self) -> "ConfigBase":
        if self.data.columns is not None:
            # a value other than the default (a dumped configuration carries the defaults, harmlessly)
            given = [
                key
                for key in ("lower", "upper")
                if getattr(self.preprocess, key) != PreprocessConfig.model_fields[key].default
            ]
            if given:
                raise ValueError(
                    f"preprocess.{given[0]} = {getattr(self.preprocess, given[0])}: not used with "
                    "data.columns, where each numeric column declares its own lower and upper"
                )
        if self.data.source.partition(":")[0] in ("csv", "parquet") and self.preprocess.features == "scatternet":
            raise ValueError(
                "preprocess.features = 'scatternet': ScatterNet features are for images, not a "
                f"table ({self.data.source})"
            )
        tokens = [name for name, column in (self.data.columns or {}).items() if column.type == "tokens"]
        if tokens and self.model.kind != "custom":
            raise ValueError(
                f"model.kind = {self.model.kind!r}: data.columns.{tokens[0]} holds token ids, which only a "
                "model taking input_ids and attention_mask reads; use model.kind: custom with such a factory"
            )
        trainer = trainer_for(self)  # type: ignore[arg-type]
        problems = []
        if self.model.kind not in trainer.model_kinds:
            reason = f"{trainer.model_kind_reason}; " if trainer.model_kind_reason else ""
            problems.append(
                f"model.kind = {self.model.kind!r}: {reason}use model.kind: {' or '.join(trainer.model_kinds)}"
            )
        if self.train.world_size > 1 and not trainer.distributed:
            problems.append(
                f"train.world_size = {self.train.world_size}: this trainer runs in one process; "
                "use train.world_size: 1 (train.algorithm: dpsgd or dpgd run distributed)"
            )
        problems += trainer.check(self)  # type: ignore[arg-type]
        if problems:
            raise ValueError(f"train.algorithm = {trainer.name!r}:\n    " + "\n    ".join(problems))
        if self.model.kind == "lipschitz" and any(width % 2 for width in self.model.hidden):
            raise ValueError(f"model.hidden = {self.model.hidden}: a lipschitz model needs even widths (GroupSort2)")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def with_hyperparameters(self, chosen: dict[str, Any]) -> Self:
        """This configuration with ``{"train.learning_rate": 0.5, …}`` applied and validated again (a method,
        so that the trainers below this module can vary the configuration they are given)."""
        overrides = [
            f"{key}={yaml.safe_dump(value, default_flow_style=True).strip().removesuffix('...').strip()}"
            for key, value in chosen.items()
        ]
        return validate(apply_overrides(self.to_dict(), overrides), origin=f"hyperparameters {chosen}")

    def flat(self) -> dict[str, Any]:
        """``{"dp.delta": 1e-5, …}``: the form logged as MLflow params."""
        out: dict[str, Any] = {}
        for section, values in self.to_dict().items():
            if not isinstance(values, dict):  # plugins: a list of modules
                if values:
                    out[section] = ",".join(values)
                continue
            for key, value in values.items():
                out[f"{section}.{key}"] = value
        return out

    def run_params(self) -> dict[str, Any]:
        """:meth:`flat` without the sections of the trainers that did not run (a reviewer reads the settings
        of this run on its MLflow page, not every registered trainer's defaults); ``config.json`` logged
        with the run keeps the whole configuration."""
        unused = {
            name for trainer in TRAINERS.values() if trainer.name != self.train.algorithm for name in trainer.sections
        }
        return {key: value for key, value in self.flat().items() if key.split(".", 1)[0] not in unused}


def compose() -> type[ConfigBase]:
    """The configuration model for the registered trainers: ``train`` is the discriminated union of
    their settings (``algorithm`` is the tag); each trainer's own sections are added with their defaults."""
    members = tuple(trainer.settings for trainer in TRAINERS.values())
    union = Annotated[Union[members], Field(discriminator="algorithm")]  # type: ignore[valid-type]
    default_train = TRAINERS["dpsgd"].settings
    fields: dict[str, Any] = {"train": (union, Field(default_factory=default_train))}
    for trainer in TRAINERS.values():
        for name, section in trainer.sections.items():
            if name in fields or name in ConfigBase.model_fields:
                raise ValueError(f"trainer {trainer.name!r}: section {name!r} is already defined")
            fields[name] = (section, Field(default_factory=section))
    return create_model("Config", __base__=ConfigBase, __module__=__name__, **fields)


if TYPE_CHECKING:

    class Config(ConfigBase):
        """What the type checker reads :data:`Config` as: the common sections typed, and ``train`` and the
        trainers' own sections (composed at run time from the registry, :func:`compose`) read as ``Any``."""

        train: Any

        def __getattr__(self, name: str) -> Any: ...
else:
    Config = compose()
_COMPOSED_FOR = tuple(TRAINERS.values())


def config_model() -> type[ConfigBase]:
    """:data:`Config` for the trainers registered now: composed again when one was registered since (a plugin's,
    :func:`dpml.train.registry.register`), so that the registry need not know this module."""
    global Config, _COMPOSED_FOR
    registered = tuple(TRAINERS.values())
    if registered != _COMPOSED_FOR:
        Config, _COMPOSED_FOR = compose(), registered  # type: ignore[misc]  # (a class to the type checker)
    return Config


def format_errors(error: ValidationError, origin: str) -> str:
    """A validation error as one line per problem, each naming its key, its value and what is allowed."""
    lines = [f"invalid configuration ({origin}):"]
    for item in error.errors():
        loc = list(item["loc"])
        if len(loc) > 1 and loc[0] == "train" and loc[1] in TRAINERS:
            del loc[1]  # the union member's tag: the key is train.KEY
        if len(loc) > 3 and loc[:2] == ["data", "columns"] and loc[3] in ("numeric", "categorical"):
            del loc[3]  # the column's type tag: the key is data.columns.NAME.KEY
        if item["type"] == BOOLEAN_FOR_NUMBER:
            loc.append(item["ctx"]["field"])
        key = ".".join(str(p) for p in loc)
        msg = item["msg"].removeprefix("Value error, ")
        if item["type"] in ("union_tag_invalid", "union_tag_not_found") and loc[:2] == ["data", "columns"]:
            tag = item.get("ctx", {}).get("tag")
            lines.append(
                f"  {key}.type{'' if tag is None else f' = {tag!r}'}: "
                f"{'required' if tag is None else 'unknown column type'}; use numeric or categorical"
            )
        elif item["type"] == "union_tag_invalid":
            lines.append(
                f"  {key}.algorithm = {item['ctx']['tag']!r}: unknown trainer; registered: "
                f"{', '.join(TRAINERS)} (a trainer of your own: list its module under plugins:)"
            )
        elif item["type"] == "extra_forbidden":
            lines.append(f"  {key} = {item['input']!r}: unknown key")
        elif item["type"] == "missing":
            lines.append(f"  {key}: required")
        elif item["type"] == BOOLEAN_FOR_NUMBER:
            lines.append(f"  {key} = {item['ctx']['value']}: {msg}")
        elif key and "input" in item and not isinstance(item["input"], dict):
            lines.append(f"  {key} = {item['input']!r}: {msg}")
        else:
            lines.append(f"  {key or '(top level)'}: {msg}")
    return "\n".join(lines)


def _check_finite(raw: Any, origin: str = "params", path: tuple[Any, ...] = ()) -> None:
    """Every number of a raw configuration (mappings and lists, any depth) is finite: a budget, ε, δ, σ or
    bound of ``inf`` or ``nan`` bounds nothing. (Text such as ``"inf"`` in a numeric field is refused by
    the sections' own validation, :class:`dpml.sections.Section`.)"""
    if isinstance(raw, dict):
        for key, value in raw.items():
            _check_finite(value, origin, (*path, key))
    elif isinstance(raw, (list, tuple)):
        for index, value in enumerate(raw):
            _check_finite(value, origin, (*path, index))
    elif (
        isinstance(raw, float)
        and not math.isfinite(raw)
        or (isinstance(raw, int) and not isinstance(raw, bool) and abs(raw) > sys.float_info.max)
    ):
        shown = raw if isinstance(raw, float) else f"{str(raw)[:20]}… (beyond the float range)"
        raise ConfigError(f"invalid configuration ({origin}):\n  {dotted(path)} = {shown}: must be a finite number")


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``section.key=value`` overrides (value parsed as YAML, :func:`safe_yaml`) to a raw config mapping.

    The key is a dotted path of two or more parts (``dp.delta``, ``data.columns.age.upper``); missing
    mappings on the way are created. The value is read like the file (duplicate keys inside it are an
    error, names and categories keep their text, numbers must be finite). Giving the same key in two
    ``--set`` flags is allowed: the last flag wins, as with most command lines (``git -c``, ``dvc exp run
    -S``); the validated configuration, logged with the run, shows the value that was used."""
    result = copy.deepcopy(raw)
    for item in overrides:
        key, sep, text = item.partition("=")
        parts = key.strip().split(".")
        if not sep or len(parts) < 2 or not all(p.strip() for p in parts):
            raise ConfigError(f"invalid override {item!r}: expected section.key=value, e.g. dp.target_epsilon=2")
        parts = [p.strip() for p in parts]
        try:
            value = safe_yaml(text, f"--set {key.strip()}", base=tuple(parts)) if text.strip() else None
        except ConfigError as error:
            message = str(error)
            if "not valid YAML: " in message:
                message = f"{key.strip()} = {text!r} is not valid YAML ({message.split('not valid YAML: ', 1)[-1]})"
            raise ConfigError(f"invalid override {item!r}: {message}") from None
        target = result
        for depth, part in enumerate(parts[:-1]):
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ConfigError(
                    f"invalid override {item!r}: {'.'.join(parts[: depth + 1])} is not a section (a mapping of keys)"
                )
        target[parts[-1]] = value
    return result


_IMPORTED_PLUGIN_FILES: dict[Path, Any] = {}


def import_plugins(names: Any, origin: str = "params") -> None:
    """Import the modules listed under ``plugins:`` so that the trainers they register validate.

    Each entry is a dotted module name (``mypackage.my_trainer``) or a path to a ``.py`` file
    (relative to the working directory, as DVC and the CLI run from the repository root). A file is
    imported once per process, so validating the same configuration twice registers nothing twice.
    """
    if not isinstance(names, list) or not all(isinstance(name, str) and name.strip() for name in names):
        raise ConfigError(
            f"invalid configuration ({origin}):\n  plugins = {names!r}: expected a list of module names or .py files"
        )
    for index, name in enumerate(names):
        try:
            if name.endswith(".py"):
                _import_plugin_file(Path(name))
            else:
                importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - any failure of a user's module is reported with its key
            raise ConfigError(
                f"invalid configuration ({origin}):\n  plugins[{index}] = {name!r}: cannot import it: "
                f"{type(error).__name__}: {error}"
            ) from None


def _import_plugin_file(path: Path) -> None:
    resolved = path.resolve()
    if resolved in _IMPORTED_PLUGIN_FILES:
        return
    if not resolved.is_file():
        raise FileNotFoundError(
            f"{path} is a directory, not a .py file" if resolved.is_dir() else f"no such file {path}"
        )
    module_name = f"dpml_plugin_{resolved.stem}"
    spec = importlib.util.spec_from_file_location(module_name, resolved)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    _IMPORTED_PLUGIN_FILES[resolved] = module


MAX_CONFIG_BYTES = MAX_BYTES  # a parameter file is a few kilobytes; refuse anything absurd
MAX_CONFIG_NODES = MAX_NODES  # nodes after expanding aliases (a "billion laughs" file expands to 10⁹)


def safe_yaml(text: str, origin: str, base: tuple[str, ...] = ()) -> Any:
    """The YAML ``text`` read strictly (:mod:`dpml.params_yaml`): duplicate keys at any level refused with
    both lines, YAML 1.2 numbers and only finite ones, a table's names and category texts as written
    (:data:`dpml.data.schema.VERBATIM_VALUES`), bounded size and alias expansion. ``base``: where the
    text sits (``("dp", "delta")`` for ``--set dp.delta=…``)."""
    try:
        return load_yaml(text, origin, base, VERBATIM_VALUES, VERBATIM_KEYS)
    except YamlError as error:
        raise ConfigError(str(error)) from None


def validate(raw: Any, origin: str = "params") -> Config:
    """Validate a raw mapping into a :class:`Config`, or raise :class:`ConfigError`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"invalid configuration ({origin}): expected a mapping of sections, got {type(raw).__name__}")
    _check_finite(raw, origin)
    if "plugins" in raw:
        import_plugins(raw["plugins"], origin)
    try:
        return config_model().model_validate(raw)
    except ValidationError as error:
        raise ConfigError(format_errors(error, origin)) from None


def with_hyperparameters(config: Config, chosen: dict[str, Any]) -> Config:
    """``config`` with ``{"train.learning_rate": 0.5, …}`` applied and validated again."""
    return config.with_hyperparameters(chosen)


def check_tunable(config: Config) -> None:
    """Reject a search that cannot run, before any work: the trainer must be searchable
    (:meth:`Trainer.search_problems`) and every candidate must be a valid config."""
    problems = [f"  {problem}" for problem in trainer_for(config).search_problems(config)]
    for key, values in config.tune.space.items():
        for value in values:
            try:
                with_hyperparameters(config, {key: value})
            except ConfigError as error:
                problems.append(f"  tune.space[{key!r}] value {value!r}: " + str(error).splitlines()[-1].strip())
    if problems:
        raise ConfigError("invalid configuration for dpml tune:\n" + "\n".join(problems))


def absolute_paths(config: Config) -> Config:
    """``config`` with its output paths pinned to the working directory (workers elsewhere write there)."""
    paths = {k: str(Path(v).resolve()) for k, v in config.paths.model_dump().items() if v is not None}
    return config.model_copy(update={"paths": config.paths.model_copy(update=paths)})


def load(
    path: str | Path = "params.yaml", overrides: list[str] | None = None, environ: Mapping[str, str] | None = None
) -> Config:
    """Read, override and validate ``params.yaml`` (UTF-8, a byte-order mark allowed): the edge of a run,
    where its destinations are resolved.

    Where the run writes (``tracking.uri``, ``registry_uri``, ``experiment``) follows one precedence:
    ``overrides`` > MLflow's variables in ``environ`` (default: this process's environment) > the file >
    the default (:mod:`dpml.routing`); below this, nothing reads those variables again."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"configuration file {path} does not exist")
    if path.is_dir():
        raise ConfigError(
            f"configuration file {path} is a directory; give the parameter file itself (e.g. {path / 'params.yaml'})"
        )
    if not path.is_file():
        raise ConfigError(f"configuration file {path} is not a regular file")
    try:
        if path.stat().st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes; not a parameter file")
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as error:
        raise ConfigError(
            f"configuration file {path}: not UTF-8 text (byte {error.object[error.start]:#04x} at "
            f"offset {error.start}); save it as UTF-8"
        ) from None
    except OSError as error:
        raise ConfigError(f"configuration file {path}: cannot read it ({error.strerror or error})") from None
    raw = safe_yaml(text, str(path))
    if raw is None and not overrides:
        raise ConfigError(f"configuration file {path} is empty (no sections; comments only)")
    if isinstance(raw, dict) or raw is None:
        try:
            raw = resolve_tracking(raw or {}, overrides or [], os.environ if environ is None else environ, str(path))
        except RoutingError as error:
            raise ConfigError(f"invalid configuration ({path}):\n  {error}") from None
    if overrides:
        if raw is not None and not isinstance(raw, dict):
            raise ConfigError(
                f"invalid configuration ({path}): expected a mapping of sections, got {type(raw).__name__}"
            )
        raw = apply_overrides(raw or {}, overrides)
    return validate(raw, origin=str(path))
