"""YAML from a file someone else wrote, read with a bound on what aliases and nesting can make of it.

PyYAML composes an alias as a second reference to its anchor's node, so a few hundred bytes of nested
aliases (the "billion laughs") compose in microseconds into a graph that any walk over the loaded
document, and pydantic's validation, expands into billions of nodes.  kubectl reads aliases, and a
manifest may use one to share a block between services, so they are bounded rather than refused: while
the document is composed, before anything is constructed or walked, every node keeps the size it has
once its aliases are expanded, and the document is refused as soon as its aliases add more than
``MAX_ALIAS_NODES`` nodes, or as soon as it nests deeper than ``MAX_DEPTH`` (PyYAML composes nesting by
recursion, and runs out of Python's stack a few hundred levels down).  Both bounds are far above what a
checkpoint identity, a DynamoCheckpoint or a DGD needs, and far below what takes noticeable time.
"""

from __future__ import annotations

from typing import Any

import yaml
from yaml.error import Mark
from yaml.events import AliasEvent
from yaml.nodes import MappingNode, Node, SequenceNode

__all__ = ["MAX_ALIAS_NODES", "MAX_DEPTH", "YAMLTooLarge", "safe_load_bounded"]

MAX_ALIAS_NODES = 10_000
MAX_DEPTH = 100


class YAMLTooLarge(ValueError):
    """The document would expand past a bound; the message says which and where."""


class _BoundedLoader(yaml.SafeLoader):
    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._expanded_size: dict[int, int] = {}  # id(node) -> its node count with aliases expanded
        self._alias_nodes = 0
        self._depth = 0

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        alias = self.check_event(AliasEvent)
        event = self.current_event  # what check_event has just read, not yet consumed
        if not alias:
            self._depth += 1
            if self._depth > MAX_DEPTH:
                raise YAMLTooLarge(
                    f"nested deeper than {MAX_DEPTH} levels ({_where(event.start_mark)}); "
                    "no identity, DynamoCheckpoint or DGD nests that deep"
                )
        node = super().compose_node(parent, index)
        if node is None:
            return None
        if alias:
            self._count_alias(event.anchor, node, event.start_mark)
        else:
            self._depth -= 1
            self._expanded_size[id(node)] = 1 + sum(
                self._expanded_size[id(child)] for child in _children(node)
            )
        return node

    def _count_alias(self, anchor: str, node: Node, mark: Mark) -> None:
        size = self._expanded_size.get(id(node))
        if size is None:  # its anchor is still being composed: the node would contain itself
            raise YAMLTooLarge(f"alias *{anchor} ({_where(mark)}) refers to a node that contains it")
        self._alias_nodes += size
        if self._alias_nodes > MAX_ALIAS_NODES:
            raise YAMLTooLarge(
                f"aliases expand to more than {MAX_ALIAS_NODES} nodes (*{anchor} at {_where(mark)}); "
                "write the repeated parts out, or use fewer aliases"
            )


def _where(mark: Mark) -> str:
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [part for pair in node.value for part in pair]
    return []


def safe_load_bounded(text: str) -> Any:
    """``yaml.safe_load(text)``, refusing with :class:`YAMLTooLarge` a document whose aliases expand past
    ``MAX_ALIAS_NODES`` nodes, that nests deeper than ``MAX_DEPTH`` levels, or whose alias refers to a
    node that contains it; malformed YAML raises ``yaml.YAMLError`` as ``safe_load`` does."""
    loader = _BoundedLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()
