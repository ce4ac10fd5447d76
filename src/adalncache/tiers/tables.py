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
* at every lookup, a bound file's binding against the binding the cache would give its own tables
  *now* (spec, precision, shard, alignment, and the numeric environment, which holds the autocast
  state and the matmul switches of this moment): a file that differs serves nothing while it
  differs (under ``torch.autocast``, say), and an SGLang file serves only outside autocast;
* whenever the weight source's identity changed since the files were last checked (a checkpoint
  rewritten or replaced on disk, :attr:`~adalncache.identity.binding.TableIdentity.generation`): a bound
  file's content digest against the source's new one, learnt from the digest memo or by one
  hashing read, and only when the file holds a plan the build wants. A file that no longer matches
  is never consulted again; an SGLang file, which nothing can check, is not consulted again either;
* on every read: a bound slot whose bytes fail their digest is a miss (counted in
  ``tables_corrupt``), never wrong rows. A file changed on disk since it was opened is not read
  again (a table file is read-only by contract; reopen the cache to use a new one).

A vLLM-Omni sidecar (:mod:`adalncache.vllm_omni`) carries a manifest instead of a binding: at
construction its ``math`` block must be this device's and, where the cache has weights, its weight
digests the source's (one hashing read); at every lookup the ``math`` block again (and no
autocast); after the source changed, the weight digests again. It records each plan's time
embedding, so a plan is served only where the build's own projection input equals ``silu`` of
it (a build without ``embed=`` trusts the file, as vLLM-Omni does).

Tables hold the base projection (no LoRA), so the tier serves nothing while a variant (a LoRA
signature) is active.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .. import vllm_omni
from ..errors import ConfigError
from ..identity import plain_json
from ..options import TablesArg, flag
from ..plans import PlanKey, format_plan, key_to_plan
from ..rows import PlanRows
from ..spec import ModulationSpec
from ..tablefile import TableFile

log = logging.getLogger(__name__)

#: What ``tables=`` may be: one path, or several searched in order.

#: Binding fields a bound file must share with the cache, besides the content digest.
_CHECKED = ("spec", "precision", "environment", "shard")

#: The ranks' any-of over a list of flags (the identity in one process).
AnyOf = Callable[[list[bool]], list[bool]]


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
        f"tables= must be a table file path or a non-empty list of them, got {type(tables).__name__} "
        f"(CLI {flag('tables')})"
    )


class TablesTier:
    """Several table files searched in order; plans come back as :class:`~adalncache.rows.PlanRows`."""

    def __init__(self, tables: TablesArg, spec: ModulationSpec, *, source: Any = None) -> None:
        """``source``: the cache's weight source, whose tensors a vLLM-Omni sidecar's weight digests are checked
        against (None, or a source without weights: those digests cannot be checked, which is logged)."""
        self.spec = spec
        self.source = source
        self.files = [TableFile(path, spec, argument="tables=") for path in table_paths(tables)]
        self.corrupt = 0
        #: Files never served again: changed on disk, or bound to content the source no longer has.
        self._gone: set[Path] = set()
        #: The source identity generation the bound files' content was last checked against.
        self._checked: int | None = None
        #: (file, reason) pairs already logged, so a file skipped at every lookup is logged once.
        self._said: set[tuple[Path, str]] = set()
        #: A vLLM-Omni sidecar's weight check, by (file, source fingerprint): the names that differ.
        self._weights_checked: dict[tuple[Path, str], list[str]] = {}

    def __repr__(self) -> str:
        return f"TablesTier({[str(f.path) for f in self.files]})"

    def check_bindings(
        self, template: Mapping[str, Any], content: Callable[[], str | None], *, generation: int = 0
    ) -> None:
        """Refuse (ConfigError) a file this cache cannot serve bit-exactly; see the module docstring.

        ``template``: the cache's binding without its content; ``content()``: the source's content
        digest (None when it has no weights to hash), asked only if a bound file needs it;
        ``generation``: the source identity it was asked under.
        """
        self._checked = generation
        precision = template.get("precision")
        bound = [t for t in self.files if t.binding is not None]
        # Asked first, whatever the files say: in a process group it is a collective every rank joins.
        digest = content() if bound else None
        for table in self.files:
            if table.manifest is not None:
                self._check_sidecar(table, template)
                continue
            if table.binding is None:
                if precision != "match":
                    raise ConfigError(
                        f"{table.path} (tables=) is an sglang table file, which holds tables of the projection "
                        f"as computed (precision 'match'); this cache has precision={precision!r}: use "
                        f"precision='match' (CLI {flag('precision')}) or export a bound file with "
                        f"{flag('precision')} {precision}"
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
                    f"(adalncache export {flag('device')}, {flag('precision')}, {flag('shard')})"
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

    def _check_sidecar(self, table: TableFile, template: Mapping[str, Any]) -> None:
        """Refuse a vLLM-Omni sidecar this cache cannot serve: precision, numeric environment, weight digests."""
        assert table.manifest is not None
        precision = template.get("precision")
        if precision != "match":
            raise ConfigError(
                f"{table.path} (tables=) is a vLLM-Omni sidecar, which holds the native projection's output "
                f"(precision 'match'); this cache has precision={precision!r}: use precision='match' (CLI "
                f"{flag('precision')})"
            )
        here = vllm_omni.math_of_environment(template.get("environment") or {})
        if plain_json(here) != plain_json(table.manifest["math"]):
            raise ConfigError(
                f"{table.path} (tables=) was built under another numeric environment (file {table.manifest['math']}, "
                f"here {here}); its tables are not what this cache computes bit for bit: export it on this machine "
                f"class (adalncache export {flag('format')} vllm-omni {flag('device')} ...)"
            )
        wrong = self._sidecar_weights(table)
        if wrong:
            raise ConfigError(
                f"{table.path} (tables=) was built from other weights than this cache's ({', '.join(wrong[:3])}"
                f"{', ...' if len(wrong) > 3 else ''} differ from its manifest): export it from this checkpoint"
            )

    def _sidecar_weights(self, table: TableFile) -> list[str]:
        """Names whose digest in the sidecar's manifest differs from this cache's weights (one hashing read).

        Remembered per file and source fingerprint: a move to another device checks the ``math`` block
        again, not the weights, and a changed checkpoint (another fingerprint) is hashed again.
        """
        assert table.manifest is not None
        key = (table.path, str(getattr(self.source, "fingerprint", None)))
        if key not in self._weights_checked:
            digests = vllm_omni.input_digests(self.source, self.spec)
            if digests is None:
                log.info("%s: no weights to hash here: the sidecar's weight digests were not checked", table.path)
                return []
            self._weights_checked[key] = vllm_omni.weight_mismatches(table.manifest, digests)
        return self._weights_checked[key]

    def _say(self, table: TableFile, reason: str, message: str, *args: Any) -> None:
        if (table.path, reason) not in self._said:
            self._said.add((table.path, reason))
            log.warning(message, *args)

    def _recheck(
        self, keys: Sequence[PlanKey], generation: int, content: Callable[[], str | None], agree: AnyOf
    ) -> None:
        """The source's identity moved since the last check: check every live file's content again (see above)."""
        live = [t for t in self.files if t.path not in self._gone]
        for table in [t for t in live if t.manifest is not None]:
            if self._sidecar_weights(table):
                self._gone.add(table.path)
                log.warning(
                    "%s was exported from other weights than the checkpoint now holds: no longer served", table.path
                )
        live = [t for t in live if t.path not in self._gone]
        for table in [t for t in live if t.binding is None and t.manifest is None]:
            self._gone.add(table.path)
            log.warning(
                "%s: the weight source changed on disk and an sglang table file carries no binding to check "
                "it against: no longer served",
                table.path,
            )
        bound = [t for t in live if t.binding is not None]
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
                log.warning(
                    "%s was exported from other projection weights (content %s) than the checkpoint now "
                    "holds (%s): no longer served",
                    table.path,
                    table.content,
                    digest,
                )
        self._checked = generation

    def _fits(self, table: TableFile, template: Mapping[str, Any]) -> bool:
        """Whether ``table`` holds what this cache would compute now (its binding against ``template``)."""
        environment = template.get("environment") or {}
        if table.manifest is not None:
            here = vllm_omni.math_of_environment(environment)
            if environment.get("autocast") is not None or plain_json(here) != plain_json(table.manifest["math"]):
                self._say(
                    table,
                    "math",
                    "%s: a vLLM-Omni sidecar of another numeric environment (or autocast) than "
                    "this build's: not served while it differs",
                    table.path,
                )
                return False
            return template.get("precision") == "match"
        if table.binding is None:
            if environment.get("autocast") is not None:
                self._say(
                    table,
                    "autocast",
                    "%s: an sglang table file holds tables computed without autocast: not served under torch.autocast",
                    table.path,
                )
                return False
            return template.get("precision") == "match"
        checked = [*_CHECKED, *(["alignment"] if template.get("alignment") is not None else [])]
        differs = [key for key in checked if plain_json(table.binding.get(key)) != plain_json(template.get(key))]
        if differs:
            self._say(
                table,
                repr(differs),
                "%s was exported under another %s than this build runs under (autocast, "
                "matmul settings or threads, say): not served while it differs",
                table.path,
                ", ".join(differs),
            )
            return False
        return True

    def lookup(
        self,
        keys: Sequence[PlanKey],
        *,
        template: Mapping[str, Any] | None = None,
        generation: int | None = None,
        content: Callable[[], str | None] | None = None,
        agree: AnyOf | None = None,
        embed: Callable[[torch.Tensor], Any] | None = None,
    ) -> dict[PlanKey, PlanRows]:
        """Rows of every key some file holds (first file first); a failed slot digest is a miss.

        ``template``: the binding (content left open) the cache would give tables built now; a file
        bound otherwise is skipped. ``generation``, ``content()``, ``agree``: the source identity
        generation, its content digest (hashing if it must: a collective in a group) and the ranks'
        any-of, for the check again after the source changed (module docstring). ``embed``: the build's
        ``embed(plan)``; a vLLM-Omni sidecar's plan is served only where it gives the projection input the
        file's rows were computed from (see :meth:`_same_input`).
        """
        if generation is not None and generation != self._checked and content is not None:
            self._recheck(keys, generation, content, agree or (lambda flags: flags))
            if generation != self._checked:
                return {}
        found: dict[PlanKey, PlanRows] = {}
        for table in self.files:
            todo = [k for k in keys if k not in found and k in table]
            if not todo:
                continue
            if table.path not in self._gone and template is not None and not self._fits(table, template):
                continue
            if table.path in self._gone or table.changed():
                if table.path not in self._gone:
                    self._gone.add(table.path)
                    log.warning(
                        "%s changed on disk since it was opened: no longer served (reopen the cache)", table.path
                    )
                continue
            for key in todo:
                if table.manifest is not None and not self._same_input(table, key, embed):
                    continue
                rows = table.read(key)
                if rows is None:
                    self.corrupt += 1
                    continue
                found[key] = rows
        return found

    def _same_input(self, table: TableFile, key: PlanKey, embed: Callable[[torch.Tensor], Any] | None) -> bool:
        """Whether this build's projection input for ``key`` is the one a vLLM-Omni sidecar's rows came from.

        The sidecar records each plan's fp32 time embedding; its rows are the projections of
        ``silu(temb)`` in the projections' dtype. A model whose time embedding of the plan has other
        bits (on a CPU, a one-row fp32 GEMV can change with the time embedder weights' address) would
        get rows that are not its own, so the plan is built instead. Without ``embed`` (a cache of
        table files only) nothing can be compared and the file is trusted, as vLLM-Omni trusts it.
        """
        if embed is None:
            return True
        temb = table.read_rows(vllm_omni.EMBEDDINGS, key)
        x = embed(key_to_plan(key, self.spec.plan_columns))
        if temb is None or not isinstance(x, torch.Tensor):
            return True
        wanted = F.silu(temb.to(x.device)).to(x.dtype)
        if torch.equal(x, wanted):
            return True
        self._say(
            table,
            f"input {key}",
            "%s: plan %s: this model's time embedding differs from the one the file's "
            "rows were computed from: built here instead",
            table.path,
            format_plan(key, columns=self.spec.plan_columns),
        )
        return False

    def searched(self) -> str:
        """The files searched and how many plans each holds, for messages."""
        return ", ".join(f"{t.path} [{t.plans} plans]" for t in self.files)


__all__ = ["TablesArg", "TablesTier", "plain_json", "table_paths"]
