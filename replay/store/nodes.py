"""Typed access to a run store's Zarr members. Zarr types a member as `Array | Group` and attributes as any
JSON value; the store's layout (store/run_store.py) says which each is, and this is where that is checked."""

from __future__ import annotations

from typing import Any, TypeVar

import zarr

Node = TypeVar("Node", "zarr.Array[Any]", zarr.Group)


def member(group: zarr.Group, path: str, kind: type[Node]) -> Node:
    """The array or group at `path` under `group`."""
    node = group[path]
    assert isinstance(node, kind), f"{path} is a {type(node).__name__}, not a {kind.__name__}"
    return node


def attributes(node: zarr.Array[Any] | zarr.Group) -> dict[str, Any]:
    """A member's attributes, as the JSON object they are."""
    return dict(node.attrs)
