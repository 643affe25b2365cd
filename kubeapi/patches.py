"""The three PATCH formats: JSON merge (RFC 7386), strategic merge, JSON patch (RFC 6902).

All functions return a new document and never modify their arguments.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kubeapi.errors import ApiError, bad_request
from kubeapi.jsontree import clone


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, null removes a member, anything else replaces."""
    if not isinstance(patch, dict):
        return clone(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any, merge_lists: Mapping[str, str | None]) -> Any:
    """Strategic merge patch as kubectl and client-go send it.

    Maps merge like a JSON merge patch; a list whose field has patchStrategy "merge" merges
    element-wise by its merge key (`$patch: delete` in an element removes it), a list of
    scalars with that strategy is a set union (`$deleteFromPrimitiveList/<field>` removes);
    other lists are replaced. `$patch: replace` replaces a map, `$patch: delete` removes it.
    """
    if not isinstance(patch, dict):
        raise bad_request("strategic merge patch: the patch must be a JSON object")
    return _smp_map(target if isinstance(target, dict) else {}, patch, "", merge_lists)


def _smp_map(target: dict[str, Any], patch: dict[str, Any], path: str, lists: Mapping[str, str | None]) -> Any:
    directive = patch.get("$patch")
    if directive == "replace":
        return {k: clone(v) for k, v in patch.items() if k != "$patch"}
    if directive == "delete":
        return None
    if directive is not None:
        raise bad_request(f"strategic merge patch: unknown patch type {directive!r} at {path or '<root>'}")
    result = dict(target)
    for key, value in patch.items():
        if key.startswith("$setElementOrder/") or key == "$retainKeys":
            continue  # ordering and key retention hints do not change the merged content here
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            if isinstance(result.get(name), list) and isinstance(value, list):
                result[name] = [v for v in result[name] if v not in value]
            continue
        child = f"{path}.{key}" if path else key
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict):
            existing = result.get(key)
            merged = _smp_map(existing if isinstance(existing, dict) else {}, value, child, lists)
            if merged is None:
                result.pop(key, None)
            else:
                result[key] = merged
        elif isinstance(value, list) and child in lists:
            existing = result.get(key)
            current = existing if isinstance(existing, list) else []
            result[key] = _smp_list(current, value, child, lists[child], lists)
        else:
            result[key] = clone(value)
    return result


def _smp_list(
    current: list[Any], patch: list[Any], path: str, merge_key: str | None, lists: Mapping[str, str | None]
) -> list[Any]:
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [clone(i) for i in patch if not (isinstance(i, dict) and i.get("$patch") == "replace")]
    if merge_key is None:
        merged = list(current)
        merged.extend(clone(v) for v in patch if v not in merged)
        return merged
    merged = [clone(item) for item in current]
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            raise bad_request(f"strategic merge patch: an element of {path} lacks its merge key {merge_key!r}")
        index = next(
            (i for i, old in enumerate(merged) if isinstance(old, dict) and old.get(merge_key) == item[merge_key]),
            None,
        )
        if item.get("$patch") == "delete":
            if index is not None:
                del merged[index]
            continue
        if index is None:
            merged.append(_smp_map({}, item, f"{path}[]", lists))
        else:
            merged[index] = _smp_map(merged[index], item, f"{path}[]", lists)
    return merged


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902: add, remove, replace, move, copy, test, applied in order, all or nothing.

    A malformed patch is 400 BadRequest; an operation that cannot apply is 422, as on the real server.
    """
    if not isinstance(operations, list):
        raise bad_request("json patch: the patch must be a JSON array of operations")
    doc = clone(target)
    for number, op in enumerate(operations):
        if not isinstance(op, dict) or not isinstance(op.get("op"), str) or not isinstance(op.get("path"), str):
            raise bad_request(f"json patch: operation {number} needs string members 'op' and 'path'")
        kind = op["op"]
        try:
            if kind == "add":
                doc = _add(doc, op["path"], clone(_member(op, "value", number)))
            elif kind == "remove":
                doc, _ = _remove(doc, op["path"])
            elif kind == "replace":
                doc, _ = _remove(doc, op["path"])
                doc = _add(doc, op["path"], clone(_member(op, "value", number)))
            elif kind == "move":
                source = _member(op, "from", number)
                if op["path"].startswith(source + "/"):
                    raise _unprocessable(f"cannot move {source} into its own child {op['path']}")
                doc, value = _remove(doc, source)
                doc = _add(doc, op["path"], value)
            elif kind == "copy":
                doc = _add(doc, op["path"], clone(_get(doc, _member(op, "from", number))))
            elif kind == "test":
                if _get(doc, op["path"]) != _member(op, "value", number):
                    raise _unprocessable(f"testing value {op['path']} failed")
            else:
                raise bad_request(f"json patch: operation {number} has unknown op {kind!r}")
        except _PointerError as e:
            raise _unprocessable(f"{kind} operation does not apply: {e}") from None
    return doc


class _PointerError(Exception):
    pass


def _unprocessable(message: str) -> ApiError:
    return ApiError(422, message)


def _member(op: dict[str, Any], name: str, number: int) -> Any:
    if name not in op:
        raise bad_request(f"json patch: operation {number} ({op['op']}) is missing {name!r}")
    return op[name]


def _tokens(pointer: str) -> list[str]:
    if pointer == "":
        return []
    if not pointer.startswith("/"):
        raise _PointerError(f"path {pointer!r} does not start with '/'")
    return [t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/")]


def _index(container: list[Any], token: str, pointer: str, *, insert: bool) -> int:
    if token == "-" and insert:
        return len(container)
    if not token.isdigit() or (len(token) > 1 and token.startswith("0")):
        raise _PointerError(f"{pointer}: {token!r} is not an array index")
    index = int(token)
    if index > len(container) or (index == len(container) and not insert):
        raise _PointerError(f"{pointer}: index {index} is out of range")
    return index


def _parent(doc: Any, pointer: str) -> tuple[Any, str]:
    tokens = _tokens(pointer)
    if not tokens:
        raise _PointerError("the whole document cannot be the target here")
    parent = doc
    for token in tokens[:-1]:
        parent = _step(parent, token, pointer)
    return parent, tokens[-1]


def _step(node: Any, token: str, pointer: str) -> Any:
    if isinstance(node, dict):
        if token not in node:
            raise _PointerError(f"{pointer}: member {token!r} does not exist")
        return node[token]
    if isinstance(node, list):
        return node[_index(node, token, pointer, insert=False)]
    raise _PointerError(f"{pointer}: {token!r} reaches into a scalar")


def _get(doc: Any, pointer: str) -> Any:
    node = doc
    for token in _tokens(pointer):
        node = _step(node, token, pointer)
    return node


def _add(doc: Any, pointer: str, value: Any) -> Any:
    if pointer == "":
        return value
    parent, token = _parent(doc, pointer)
    if isinstance(parent, dict):
        parent[token] = value
    elif isinstance(parent, list):
        parent.insert(_index(parent, token, pointer, insert=True), value)
    else:
        raise _PointerError(f"{pointer}: parent is a scalar")
    return doc


def _remove(doc: Any, pointer: str) -> tuple[Any, Any]:
    parent, token = _parent(doc, pointer)
    if isinstance(parent, dict):
        if token not in parent:
            raise _PointerError(f"{pointer}: member {token!r} does not exist")
        return doc, parent.pop(token)
    if isinstance(parent, list):
        return doc, parent.pop(_index(parent, token, pointer, insert=False))
    raise _PointerError(f"{pointer}: parent is a scalar")
