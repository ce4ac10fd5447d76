"""Table files as a read-only tier below the store (``tables=``).

A team builds the tables of its schedules once (``adalncache export``), ships the file with the
model, and every serving process reads from it instead of streaming 24 GiB of projection weights.
This tier opens the files given, refuses at once any that cannot serve this cache, and restores
plans from them like the store does: a plan's rows are read from the first file (in the order
given) that holds the plan, and checked against the slot's digest in a bound file.

What is checked, and when:

* at open (:class:`TablesTier`), every file: structure and geometry (the four tensors, their
  dtypes and shapes against the cache's spec, ``format_version``, plan lengths), raising
  ``ConfigError`` naming the file;
* at construction of the cache (:meth:`TablesTier.check_bindings`), a bound file's binding against
  the cache: the spec, the precision, the numeric environment and the shard mode must be the
  cache's, and its content digest the source's (when the cache has weights to hash). An SGLang
  file carries no binding: only its geometry can be checked, it is served as ``precision="match"``
  tables, and a cache of another precision refuses it;
* on every read: a bound slot whose bytes fail their digest is a miss (counted in
  ``tables_corrupt``), never wrong rows. A file changed on disk since it was opened is not read
  again (a table file is read-only by contract; reopen the cache to use a new one).

Tables hold the base projection (no LoRA), so the tier serves nothing while a variant (a LoRA
signature) is active.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..plans import PlanKey
from ..rows import PlanRows
from ..spec import ModulationSpec
from ..tablefile import TableFile

log = logging.getLogger(__name__)

#: What ``tables=`` may be: one path, or several searched in order.
TablesArg = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]

#: Binding fields a bound file must share with the cache, besides the content digest.
_CHECKED = ("spec", "precision", "environment", "shard")


def table_paths(tables: Any) -> list[Path]:
    """``tables=`` as a list of paths (ConfigError for anything else)."""
    if isinstance(tables, (str, os.PathLike)):
        return [Path(tables)]
    if (
        isinstance(tables, Sequence)
        and not isinstance(tables, bytes)
        and tables
        and all(isinstance(t, (str, os.PathLike)) for t in tables)
    ):
        return [Path(t) for t in tables]
    raise ConfigError(
        f"tables= must be a table file path or a non-empty list of them, got {type(tables).__name__} (CLI --tables)"
    )


class TablesTier:
    """Several table files searched in order; plans come back as :class:`~adalncache.rows.PlanRows`."""

    def __init__(self, tables: TablesArg, spec: ModulationSpec) -> None:
        self.spec = spec
        self.files = [TableFile(path, spec, argument="tables=") for path in table_paths(tables)]
        self.corrupt = 0
        self._gone: set[Path] = set()

    def __repr__(self) -> str:
        return f"TablesTier({[str(f.path) for f in self.files]})"

    def check_bindings(self, template: Mapping[str, Any], content: Callable[[], str | None]) -> None:
        """Refuse (ConfigError) a file this cache cannot serve bit-exactly; see the module docstring.

        ``template``: the cache's binding without its content; ``content()``: the source's content
        digest (None when it has no weights to hash), asked only if a bound file needs it.
        """
        precision = template.get("precision")
        bound = [t for t in self.files if t.binding is not None]
        # Asked first, whatever the files say: in a process group it is a collective every rank joins.
        digest = content() if bound else None
        for table in self.files:
            if table.binding is None:
                if precision != "match":
                    raise ConfigError(
                        f"{table.path} (tables=) is an sglang table file, which holds tables of the projection "
                        f"as computed (precision 'match'); this cache has precision={precision!r}: use "
                        f"precision='match' (CLI --precision) or export a bound file with --precision {precision}"
                    )
                log.info("%s: an sglang table file carries no binding: only its geometry was checked", table.path)
                continue
            checked = [*_CHECKED, *(["alignment"] if template.get("alignment") is not None else [])]
            differs = [key for key in checked if plain_json(table.binding.get(key)) != plain_json(template.get(key))]
            if differs:
                detail = "; ".join(
                    f"{key}: file {plain_json(table.binding.get(key))}, here {plain_json(template.get(key))}"
                    for key in differs
                )
                raise ConfigError(
                    f"{table.path} (tables=) was exported for another {', '.join(differs)} ({detail}); its tables are "
                    f"not what this cache computes bit for bit: export on this machine class with these settings "
                    f"(adalncache export --device, --precision, --shard)"
                )
            if digest is None:
                log.info(
                    "%s: the content digest of the projections cannot be computed here (no weights): checked "
                    "spec, precision and environment only",
                    table.path,
                )
            elif table.content != digest:
                raise ConfigError(
                    f"{table.path} (tables=) was built from other projection weights (content {table.content}, this "
                    f"model's {digest}): export the tables from this checkpoint (adalncache export), or pass the "
                    f"checkpoint they came from"
                )

    def lookup(self, keys: Sequence[PlanKey]) -> dict[PlanKey, PlanRows]:
        """Rows of every key some file holds (first file first); a failed slot digest is a miss."""
        found: dict[PlanKey, PlanRows] = {}
        for table in self.files:
            todo = [k for k in keys if k not in found and k in table]
            if not todo:
                continue
            if table.path in self._gone or table.changed():
                if table.path not in self._gone:
                    self._gone.add(table.path)
                    log.warning("%s changed on disk since it was opened: no longer served (reopen the cache)",
                                table.path)  # fmt: skip
                continue
            for key in todo:
                rows = table.read(key)
                if rows is None:
                    self.corrupt += 1
                    continue
                found[key] = rows
        return found

    def searched(self) -> str:
        """The files searched and how many plans each holds, for messages."""
        return ", ".join(f"{t.path} [{t.plans} plans]" for t in self.files)


def plain_json(value: Any) -> Any:
    """A JSON round trip, so a tuple in one binding equals a list in the other."""
    return json.loads(json.dumps(value, sort_keys=True, default=str))


__all__ = ["TablesArg", "TablesTier", "plain_json", "table_paths"]
