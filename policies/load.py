"""Load a policy file: YAML with positions -> strict msgspec validation -> file-wide checks.

Every problem becomes one line ``FILE:LINE:COL: PATH (Kind 'name'): what is wrong; what to do``
(:class:`policies.errors.PolicyError`). msgspec stops at the first type error, so a file with a type
error reports that one; the file-wide checks (:mod:`policies.checks`) report all they find.

Hot reload is the gateway's job: it calls :func:`load_policy_file` when the file changes and swaps its
reference only if no PolicyError was raised. Policies are immutable values, so there is no holder here.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from pathlib import Path as FsPath
from typing import Any

import msgspec

from policies.checks import check_policy
from policies.errors import PolicyError
from policies.schema import REMOVED_LEARNING_KEYS, Policy
from policies.yamltree import Path, YamlProblem, YamlTree, parse_yaml

_NAMED_LISTS = {"routes": "Route", "slices": "Slice", "rules": "Rule"}


def load_policy_file(path: str | FsPath) -> Policy:
    """Read and load a policy file; an unreadable file is a PolicyError too."""
    path = FsPath(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PolicyError([f"{path}: cannot read policy file: {exc.strerror or exc}"]) from None
    return load_policy(text, path.name)


def load_policy(text: str, filename: str) -> Policy:
    """Parse and validate policy text; ``filename`` only labels error messages."""
    try:
        tree = parse_yaml(text)
    except YamlProblem as exc:
        raise PolicyError([f"{filename}:{exc.line}:{exc.col}: {display_path(tree=None, path=exc.path)}: "
                           f"{exc.message}"]) from None
    if not isinstance(tree.data, dict):
        raise PolicyError([f"{filename}:1:1: (top level): expected a mapping with version, slices, pools, "
                           f"rules; got {_show(tree.data)}"])
    try:
        policy = msgspec.convert(tree.data, Policy)
    except msgspec.ValidationError as exc:
        raise PolicyError([_translate(str(exc), tree, filename)]) from None
    problems = check_policy(policy, tree)
    if problems:
        raise PolicyError([f"{filename}:{line}:{col}: {display_path(tree, path)}: {msg}"
                           for (line, col), path, msg in problems])
    return policy


def display_path(tree: YamlTree | None, path: Path) -> str:
    """``rules[3] (Rule 'code-edits').then.pool``: list items of routes/slices/rules carry their name."""
    if not path:
        return "(top level)"
    out = ""
    for i, part in enumerate(path):
        if isinstance(part, int):
            out += f"[{part}]"
            if i == 1 and path[0] in _NAMED_LISTS and tree is not None:
                item = tree.get(path[:2])
                if isinstance(item, dict) and isinstance(item.get("name"), str):
                    out += f" ({_NAMED_LISTS[path[0]]} '{item['name']}')"
        else:
            out += ("." if out else "") + str(part)
    return out


def _show(value: Any) -> str:
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"'{value}'"
    return str(value)


def _unwrap(tp: Any, value: Any) -> Any:
    """Strip Annotated/Optional and pick the union member that fits ``value``'s shape."""
    while True:
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            tp = typing.get_args(tp)[0]
            continue
        if origin in (typing.Union, types.UnionType):
            members = [m for m in typing.get_args(tp) if m is not type(None)]
            pick = members[0]
            for m in members:
                base = typing.get_origin(m) or m
                if isinstance(value, dict) and (isinstance(base, type) and
                                                (issubclass(base, msgspec.Struct) or base is dict)):
                    pick = m
                elif isinstance(value, list) and base is list:
                    pick = m
            tp = pick
            continue
        return tp


def _struct_fields(tp: Any) -> dict[str, Any]:
    hints = typing.get_type_hints(tp, include_extras=True)
    return {f.encode_name: hints[f.name] for f in msgspec.structs.fields(tp)}


def _resolve(spec: str, tree: YamlTree) -> tuple[Path, Any]:
    """Turn msgspec's ``$.rules[0].when.pool.kv_usage`` into a path tuple and the type expected there."""
    rest, path, node, tp = spec[1:], [], tree.data, Policy
    while rest:
        tp = _unwrap(tp, node)
        if rest.startswith("["):
            token, rest = rest[1:rest.index("]")], rest[rest.index("]") + 1:]
            if token == "...":
                value_tp = typing.get_args(tp)[1]
                bad = [k for k, v in node.items() if not _fits(v, value_tp)]
                key = bad[0] if bad else next(iter(node))
                path.append(key)
                node, tp = node[key], value_tp
            else:
                path.append(int(token))
                node, tp = node[int(token)], typing.get_args(tp)[0]
            continue
        rest = rest[1:]
        fields = _struct_fields(tp) if isinstance(tp, type) and issubclass(tp, msgspec.Struct) else None
        names = list(fields) if fields else list(node) if isinstance(node, dict) else []
        name = max((n for n in names if rest == n or rest.startswith(n + ".") or rest.startswith(n + "[")),
                   key=len, default=re.split(r"[.\[]", rest)[0])
        path.append(name)
        rest = rest[len(name):]
        node = node.get(name) if isinstance(node, dict) else None
        tp = fields.get(name) if fields else (typing.get_args(tp)[1] if typing.get_origin(tp) is dict else None)
    return tuple(path), tp


def _fits(value: Any, tp: Any) -> bool:
    try:
        msgspec.convert(value, tp)
    except msgspec.ValidationError:
        return False
    return True


def _translate(raw: str, tree: YamlTree, filename: str) -> str:
    message, _, spec = raw.partition(" - at `")
    path, tp = _resolve(spec.rstrip("`") or "$", tree)
    value = tree.get(path)
    pos = tree.value_pos(path)
    if m := re.match(r"Object contains unknown field `(.+)`", message):
        key = m.group(1)
        allowed = list(_struct_fields(_unwrap(tp, value)))
        path, pos = path + (key,), tree.key_pos(path + (key,))
        close = difflib.get_close_matches(key, allowed, n=1)
        hint = f"did you mean '{close[0]}'?" if close else "allowed keys: " + ", ".join(allowed)
        if path[:1] == ("learning",) and key in REMOVED_LEARNING_KEYS:
            hint = ("removed: auto is Thompson sampling over options per slice, load and prompt_repeat band, "
                    "which needs no exploration rates or evidence minimums (docs/policy.md, 'auto'); delete it")
        text = f"unknown key '{key}'; {hint}"
    elif m := re.match(r"Object missing required field `(.+)`", message):
        text = f"missing required key '{m.group(1)}'"
    elif m := re.match(r"Invalid enum value (.+)", message):
        text = f"invalid value {m.group(1)}; expected one of: " + ", ".join(_choices(tp))
    elif message.startswith("Expected"):
        expected = re.sub(r"`([^`]*)`", r"\1", message[len("Expected "):]).split(", got ")[0]
        expected = expected.replace("object", "mapping").replace("array", "list")
        text = f"expected {expected}, got {_show(value)}"
    else:
        text = message
    return f"{filename}:{pos[0]}:{pos[1]}: {display_path(tree, path)}: {text}"


def _choices(tp: Any) -> list[str]:
    """The literal values (and 'a mapping' for a Struct member) a field accepts."""
    out: list[str] = []
    stack = [tp]
    while stack:
        t = stack.pop(0)
        origin = typing.get_origin(t)
        if origin is typing.Literal:
            out.extend(str(v) for v in typing.get_args(t))
        elif origin is typing.Annotated:
            stack.insert(0, typing.get_args(t)[0])
        elif origin is not None and origin is not list and origin is not dict:
            stack.extend(typing.get_args(t))
        elif isinstance(t, type) and issubclass(t, msgspec.Struct):
            out.append("a mapping with " + ", ".join(_struct_fields(t)))
        elif t is int:
            out.append("an integer")
    return out
