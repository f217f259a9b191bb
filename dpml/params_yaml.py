"""Reading ``params.yaml`` and ``--set`` values so that the text cannot say one thing and mean another.

PyYAML's ``safe_load`` accepts several things that silently change what a parameter file means;
:func:`load_yaml` refuses or fixes each, for every key at every level:

- **Duplicate keys** are an error naming the key's dotted path and both lines (``safe_load`` keeps the
  last: a second ``ledger:`` section would replace the whole first one). Keys are compared as the
  values they denote, so ``1`` and ``1.0``, or ``yes`` and ``true``, are the same key. Keys brought in
  by a merge key (``<<: *defaults``) may be overridden: that is what a merge is for.
- **Numbers are read as YAML 1.2 reads them** (the version DVC's reader speaks): ``1e-5`` and ``1e999``
  are numbers, not text (YAML 1.1 wants a dot), ``010`` is ten (not octal eight) and ``1:30`` is text
  (not the sexagesimal 90). A number that is not finite in any spelling (``.inf``, ``-.Inf``, ``.nan``,
  ``1e999``, ``-1.0e+400``, an integer beyond the float range) is an error naming its key, its text and
  its line: every number in a parameter file bounds something, and a budget of infinity is no budget.
- **Names and category texts are read as written** (``verbatim``): under the paths the caller names
  (a table's column names, category lists, class lists, missing-value tokens), a plain scalar that
  YAML 1.1 would turn into a boolean, a number, a date or null keeps the text the user typed, so
  ``categories: [no, yes]`` are the strings ``no`` and ``yes`` (not ``False``/``True``), ``[1.10]`` is
  ``"1.10"`` and ``[NO, SE, DK]`` are three country codes.
- Size bounds: a file over :data:`MAX_BYTES`, or whose aliases expand to more than :data:`MAX_NODES`
  nodes (a "billion laughs"), is refused before it is built; only the standard tags are accepted.

This module imports nothing from dpml: :mod:`dpml.config` builds the configuration on it.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Sequence
from typing import Any

import yaml

MAX_BYTES = 1 << 20  # a parameter file is a few kilobytes; refuse anything absurd
MAX_NODES = 100_000  # nodes after expanding aliases (a "billion laughs" file expands to 10⁹)

Path = tuple[Any, ...]  # mapping keys, and int positions in lists
Pattern = tuple[str, ...]  # literal keys, "*" (any key) and "[]" (any list item)

_MAP, _SEQ, _MERGE = "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq", "tag:yaml.org,2002:merge"
_FLOAT, _INT, _NULL = "tag:yaml.org,2002:float", "tag:yaml.org,2002:int", "tag:yaml.org,2002:null"
_STR = "tag:yaml.org,2002:str"

# YAML 1.2 core schema numbers (with YAML 1.1's digit separators '_').
_FLOAT_PATTERN = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?\.[0-9][0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)
_INT_PATTERN = re.compile(
    r"""^(?:[-+]?0b[0-1_]+
    |[-+]?0o[0-7_]+
    |[-+]?0x[0-9a-fA-F_]+
    |[-+]?[0-9][0-9_]*)$""",
    re.X,
)


class YamlError(ValueError):
    """A parameter text that is not valid, or says something twice; the message names where."""


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader with YAML 1.2's numbers (see the module docstring)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_FLOAT, _INT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_FLOAT, _FLOAT_PATTERN, list("-+0123456789."))
_Loader.add_implicit_resolver(_INT, _INT_PATTERN, list("-+0123456789"))


def _construct_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    """YAML 1.2: decimal (leading zeros allowed, never octal), ``0o`` octal, ``0x`` hex, ``0b`` binary."""
    text = str(loader.construct_scalar(node)).replace("_", "")
    sign = -1 if text.startswith("-") else 1
    body = text.lstrip("+-").lower()
    bases = {"0x": 16, "0o": 8, "0b": 2}
    base = bases.get(body[:2], 10)
    return sign * int(body[2:] if base != 10 else body, base)


_Loader.add_constructor(_INT, _construct_int)


def load_yaml(
    text: str,
    origin: str,
    base: Path = (),
    verbatim_values: Sequence[Pattern] = (),
    verbatim_keys: Sequence[Pattern] = (),
) -> Any:
    """The value of ``text`` (module docstring), or :class:`YamlError` naming ``origin`` and the line.

    ``base`` is where the text sits in the configuration (``("dp",)`` for ``--set dp={…}``): paths in
    messages and the ``verbatim_*`` patterns are matched from there. ``verbatim_values``: paths whose
    scalars keep their text; ``verbatim_keys``: paths of mappings whose keys keep their text."""
    if len(text.encode(errors="replace")) > MAX_BYTES:
        raise YamlError(f"{origin}: larger than {MAX_BYTES} bytes; not a parameter file")
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
    except yaml.YAMLError as error:
        raise YamlError(f"{origin}: not valid YAML: {' '.join(str(error).split())}") from None
    finally:
        loader.dispose()
    if node is None:
        return None
    if _expanded_size(node, {}) > MAX_NODES:
        raise YamlError(f"{origin}: its aliases expand to more than {MAX_NODES} nodes; refusing to load it")
    return _Builder(loader, origin, tuple(verbatim_values), tuple(verbatim_keys)).build(node, tuple(base))


def dotted(path: Path) -> str:
    """``("data", "columns", "age", "categories", 2)`` → ``data.columns.age.categories[2]``."""
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) and not isinstance(part, bool) else f"{'.' if out else ''}{part}"
    return out or "(top level)"


def _matches(path: Path, patterns: tuple[Pattern, ...]) -> bool:
    def token_matches(token: str, part: Any) -> bool:
        is_index = isinstance(part, int) and not isinstance(part, bool)
        return is_index if token == "[]" else (not is_index and (token == "*" or token == part))

    return any(
        len(p) == len(path) and all(token_matches(t, part) for t, part in zip(p, path, strict=True)) for p in patterns
    )


class _Builder:
    """Builds Python values from a composed node graph, path by path (module docstring)."""

    def __init__(
        self, loader: _Loader, origin: str, verbatim_values: tuple[Pattern, ...], verbatim_keys: tuple[Pattern, ...]
    ) -> None:
        self.loader, self.origin = loader, origin
        self.verbatim_values, self.verbatim_keys = verbatim_values, verbatim_keys

    def where(self, node: yaml.Node) -> str:
        return f"{self.origin}, line {node.start_mark.line + 1}"

    def build(self, node: yaml.Node, path: Path) -> Any:
        if isinstance(node, yaml.MappingNode):
            if node.tag != _MAP:
                raise YamlError(f"{self.where(node)}: {dotted(path)}: the tag {node.tag!r} is not allowed here")
            return self.mapping(node, path)
        if isinstance(node, yaml.SequenceNode):
            if node.tag != _SEQ:
                raise YamlError(f"{self.where(node)}: {dotted(path)}: the tag {node.tag!r} is not allowed here")
            return [self.build(child, (*path, i)) for i, child in enumerate(node.value)]
        in_list = bool(path) and isinstance(path[-1], int) and not isinstance(path[-1], bool)
        verbatim = _matches(path, self.verbatim_values)
        return self.scalar(node, path, verbatim, keep_null=not in_list)

    def scalar(self, node: yaml.ScalarNode, path: Path, verbatim: bool, keep_null: bool = False) -> Any:
        """A scalar's value: its text where ``verbatim`` (a null stays None where ``keep_null``: a setting
        left empty), else what YAML says, refusing a number that is not finite."""
        if verbatim and node.style is None and node.tag != _STR:
            return None if node.tag == _NULL and keep_null else node.value
        try:
            value = self.loader.construct_object(node, deep=True)
        except yaml.YAMLError as error:
            raise YamlError(f"{self.where(node)}: {dotted(path)}: {' '.join(str(error).split())}") from None
        if (
            isinstance(value, float)
            and not math.isfinite(value)
            or (isinstance(value, int) and not isinstance(value, bool) and abs(value) > sys.float_info.max)
        ):
            shown = node.value if len(node.value) <= 40 else f"{node.value[:20]}…({len(node.value)} characters)"
            raise YamlError(
                f"{self.where(node)}: {dotted(path)} = {shown}: not a finite number "
                f"({'it overflows to infinity' if 'nan' not in node.value.lower() else 'not a number'}); "
                "every number in the configuration must be finite"
            )
        return value

    def mapping(self, node: yaml.MappingNode, path: Path) -> dict[Any, Any]:
        """A mapping whose keys are unique (merge keys may be overridden: that is what they are for)."""
        own: dict[Any, Any] = {}
        lines: dict[Any, yaml.Node] = {}
        merged: dict[Any, Any] = {}
        verbatim_keys = _matches(path, self.verbatim_keys)
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE:
                for source in self._merge_sources(value_node, path):
                    for key, value in self.build(source, path).items():
                        merged.setdefault(key, value)
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                raise YamlError(
                    f"{self.where(key_node)}: {dotted(path)}: a key must be a plain name, not a "
                    f"{'list' if isinstance(key_node, yaml.SequenceNode) else 'mapping'}"
                )
            key = self.scalar(key_node, path, verbatim_keys)
            first = lines.get(key)
            if first is not None:
                raise YamlError(self._duplicate(path, key, first, key_node))
            lines[key] = key_node
            own[key] = self.build(value_node, (*path, key))
        return {**merged, **own}

    def _merge_sources(self, node: yaml.Node, path: Path) -> list[yaml.MappingNode]:
        sources = node.value if isinstance(node, yaml.SequenceNode) else [node]
        if not all(isinstance(s, yaml.MappingNode) for s in sources):
            raise YamlError(f"{self.where(node)}: {dotted(path)}: a merge key (<<) takes a mapping or a list of them")
        return list(sources)

    def _duplicate(self, path: Path, key: Any, first: yaml.Node, second: yaml.Node) -> str:
        a, b = first.start_mark, second.start_mark
        if a.line == b.line:
            where = f"line {a.line + 1}, columns {a.column + 1} and {b.column + 1}"
        else:
            where = f"lines {a.line + 1} and {b.line + 1}"
        if first.value == second.value:
            what = f"{dotted((*path, key))} is given twice"
        else:
            what = f"under {dotted(path)}, the keys {first.value!r} and {second.value!r} are the same key ({key!r})"
        return (
            f"{self.origin}: {what} ({where}); each key may appear once: keep one (YAML readers differ on "
            "which one wins; PyYAML silently keeps the last)"
        )


def _expanded_size(node: yaml.Node, memo: dict[int, int]) -> int:
    """Nodes in the tree an alias-sharing YAML graph expands to (memoised per shared node)."""
    if id(node) in memo:
        return memo[id(node)]
    memo[id(node)] = MAX_NODES + 1  # a cycle (recursive alias) counts as too large
    if isinstance(node, yaml.SequenceNode):
        size = 1 + sum(_expanded_size(child, memo) for child in node.value)
    elif isinstance(node, yaml.MappingNode):
        size = 1 + sum(_expanded_size(k, memo) + _expanded_size(v, memo) for k, v in node.value)
    else:
        size = 1
    memo[id(node)] = min(size, MAX_NODES + 1)
    return memo[id(node)]
