"""Table files as a read-only tier below the store (``tables=``), whatever their format.

A plan's rows come from the first file (in the order given) that holds it. What is checked is each format's
(:mod:`adalncache.formats`); *when* is this tier's (at open, at the cache's construction, at every lookup,
after the weight source changed, on every read: docs/tables.md, "Serve it"), so that no file serves rows
this cache would not compute now. Tables hold the base projection: nothing is served while a LoRA is active.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ..errors import ConfigError
from ..formats import TableFile
from ..options import TablesArg, flag
from ..plans import PlanKey
from ..slab import PlanRows
from ..spec import ModulationSpec

if TYPE_CHECKING:
    from ..identity.binding import TableIdentity

log = logging.getLogger(__name__)

#: The ranks' any-of over a list of flags (the identity in one process).
AnyOf = Callable[[list[bool]], list[bool]]
Embed = Callable[[torch.Tensor], Any]


def table_paths(tables: Any) -> list[Path]:
    """``tables=`` as a list of paths (ConfigError for anything else)."""
    if isinstance(tables, (str, os.PathLike)):
        return [Path(tables)]
    if isinstance(tables, Sequence) and tables and all(isinstance(t, (str, os.PathLike)) for t in tables):
        return [Path(t) for t in tables]
    raise ConfigError(
        f"tables= must be a table file path or a non-empty list of them, got {type(tables).__name__} "
        f"(CLI {flag('tables')})"
    )


class TablesTier:
    """Several table files searched in order. ``source``: the cache's weight source, which a file that names
    its weights is checked against (None, or a source without weights: not checked, which is logged)."""

    def __init__(self, tables: TablesArg, spec: ModulationSpec, *, source: Any = None) -> None:
        self.spec, self.source = spec, source
        self.files = [TableFile(path, spec, argument="tables=") for path in table_paths(tables)]
        self.corrupt = 0
        #: Files never served again: changed on disk, or bound to weights the source no longer has.
        self._gone: set[Path] = set()
        #: The source identity generation the files were last checked against.
        self._checked: int | None = None
        #: Messages already logged, so a file skipped at every lookup is logged once.
        self._said: set[str] = set()

    def __repr__(self) -> str:
        return f"TablesTier({[str(f.path) for f in self.files]})"

    def check_bindings(
        self, template: Mapping[str, Any], content: Callable[[], str | None], *, generation: int = 0
    ) -> None:
        """Refuse (ConfigError) a file this cache cannot serve bit-exactly.

        ``template``: the cache's binding without its content; ``content()``: the source's content digest
        (None without weights to hash), asked only if a file binds one; ``generation``: the source identity.
        """
        self._checked = generation
        # Asked first, whatever the files say: in a process group it is a collective every rank joins.
        digest = content() if any(t.kind.binds_content for t in self.files) else None
        for table in self.files:
            table.kind.check_cache(table, template, digest=digest, source=self.source)

    def _say(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            log.warning("%s", message)

    def _recheck(
        self, keys: Sequence[PlanKey], generation: int, content: Callable[[], str | None], agree: AnyOf
    ) -> None:
        """The source's identity moved since the last check: check every live file again."""
        bound = []
        for table in [t for t in self.files if t.path not in self._gone]:
            serves = table.kind.still_serves(table, self.source)
            if serves is None:
                bound.append(table)
            elif not serves:
                self._gone.add(table.path)
        wanted = any(k in t for t in bound for k in keys)
        if not agree([wanted])[0]:  # every rank asks the same question (the digest may need a collective read)
            if not bound:
                self._checked = generation
            return
        digest = content()
        if digest is None:
            return  # cannot be checked now (no weights to hash): nothing is served until it can
        for table in bound:
            if table.content != digest:
                self._gone.add(table.path)
                what = f"{table.path} was exported from other projection weights (content {table.content})"
                log.warning("%s than the checkpoint now holds (%s): no longer served", what, digest)
        self._checked = generation

    def lookup(
        self, keys: Sequence[PlanKey], identity: TableIdentity, *, agree: AnyOf, embed: Embed | None
    ) -> dict[PlanKey, PlanRows]:
        """Rows of every key some file holds (first file first); a slot its format refuses is a miss.

        A file that does not fit the binding tables built now would get is skipped. After the source identity
        moved, the files are checked again against its content digest, hashing if they must (a collective in a
        group, where ``agree`` is the ranks' any-of). ``embed``: the build's ``embed(plan)``, which a file that
        records its rows' projection input is checked against.
        """
        template, generation = identity.template(), identity.generation
        if generation != self._checked:
            self._recheck(keys, generation, identity.content.identify, agree)
            if generation != self._checked:
                return {}
        found: dict[PlanKey, PlanRows] = {}
        for table in self.files:
            todo = [k for k in keys if k not in found and k in table]
            if not todo or table.path in self._gone:
                continue
            unfit = table.kind.unfit(table, template)
            if unfit is not None:
                self._say(unfit)
                continue
            if table.changed():
                self._gone.add(table.path)
                log.warning("%s changed on disk since it was opened: no longer served (reopen the cache)", table.path)
                continue
            for key in todo:
                other_input = table.kind.same_input(table, key, embed)
                if other_input is not None:
                    self._say(other_input)
                    continue
                rows = table.read(key)
                if rows is None:
                    self.corrupt += 1
                    continue
                found[key] = rows
        return found

    def searched(self) -> str:
        """The files searched and how many plans each holds, for messages."""
        return ", ".join(f"{t.path} [{t.plans} plans]" for t in self.files)


__all__ = ["TablesArg", "TablesTier", "table_paths"]
