"""Parse YAML into plain Python values while remembering where every key and value came from.

msgspec validates plain values; to point at ``file:line:col`` we keep, for every path (a tuple of keys and
list indices), the position of its value and, for mapping entries, of its key. Duplicate mapping keys are
an error here (PyYAML would silently keep the last one, hiding a misspelled pool).
"""

from __future__ import annotations

from typing import Any

import yaml

Path = tuple[str | int, ...]


class YamlTree:
    """Plain values plus source positions (1-based line, column) by path."""

    def __init__(self, data: Any, values: dict[Path, tuple[int, int]], keys: dict[Path, tuple[int, int]]):
        self.data = data
        self._values = values
        self._keys = keys

    def value_pos(self, path: Path) -> tuple[int, int]:
        """Position of the value at ``path``, or of the nearest enclosing value that exists."""
        while path not in self._values and path:
            path = path[:-1]
        return self._values.get(path, (1, 1))

    def key_pos(self, path: Path) -> tuple[int, int]:
        """Position of the key naming ``path`` (falls back to the value position)."""
        return self._keys.get(path) or self.value_pos(path)

    def get(self, path: Path) -> Any:
        """The plain value at ``path`` or None when it is absent."""
        node = self.data
        for part in path:
            try:
                node = node[part]
            except (KeyError, IndexError, TypeError):
                return None
        return node


class YamlProblem(Exception):
    """A syntax error or duplicate key, with its position."""

    def __init__(self, line: int, col: int, path: Path, message: str) -> None:
        super().__init__(message)
        self.line, self.col, self.path, self.message = line, col, path, message


def _pos(mark: yaml.Mark) -> tuple[int, int]:
    return mark.line + 1, mark.column + 1


def parse_yaml(text: str) -> YamlTree:
    """Compose ``text`` (one document) into a :class:`YamlTree`; raise :class:`YamlProblem` on bad YAML."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        line, col = _pos(mark) if mark else (1, 1)
        raise YamlProblem(line, col, (), f"invalid YAML: {exc.problem or exc.context}") from None
    values: dict[Path, tuple[int, int]] = {}
    keys: dict[Path, tuple[int, int]] = {}
    constructor = yaml.SafeLoader("")

    def build(node: yaml.Node, path: Path) -> Any:
        values[path] = _pos(node.start_mark)
        if isinstance(node, yaml.MappingNode):
            out: dict[Any, Any] = {}
            for key_node, value_node in node.value:
                key = constructor.construct_object(key_node, deep=True)
                if isinstance(key, (list, dict)):
                    raise YamlProblem(*_pos(key_node.start_mark), path, "a mapping key must be a scalar")
                if key in out:
                    first = keys[path + (key,)]
                    raise YamlProblem(*_pos(key_node.start_mark), path + (key,),
                                      f"duplicate key '{key}' (first defined at line {first[0]}); "
                                      "remove or rename one")
                keys[path + (key,)] = _pos(key_node.start_mark)
                out[key] = build(value_node, path + (key,))
            return out
        if isinstance(node, yaml.SequenceNode):
            return [build(item, path + (i,)) for i, item in enumerate(node.value)]
        return constructor.construct_object(node, deep=True)

    data = build(root, ()) if root is not None else None
    return YamlTree(data, values, keys)
