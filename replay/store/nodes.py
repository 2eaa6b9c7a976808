"""Typed access to a run store's Zarr members. Zarr types a member as `Array | Group` and attributes as any
JSON value; the store's layout (store/run_store.py) says which each is, and this is where that is checked."""

from __future__ import annotations

from typing import Any, TypeVar

import zarr

from replay.errors import StoreError

Node = TypeVar("Node", "zarr.Array[Any]", zarr.Group)


def member(group: zarr.Group, path: str, kind: type[Node]) -> Node:
    """The array or group at `path` under `group`; a StoreError where the store holds none (it is damaged)."""
    try:
        node = group[path]
    except KeyError:
        raise StoreError(f"{path} is missing") from None
    except (ValueError, TypeError) as e:   # its zarr.json is not Zarr metadata
        raise StoreError(f"{path}/zarr.json is damaged ({(str(e).splitlines() or [''])[0]})") from None
    if not isinstance(node, kind):
        raise StoreError(f"{path} is a {type(node).__name__.lower()}, not a {kind.__name__.lower()}")
    return node


def attributes(node: zarr.Array[Any] | zarr.Group) -> dict[str, Any]:
    """A member's attributes, as the JSON object they are."""
    return dict(node.attrs)
