"""Which files make a checkpoint, their parsed headers, and the fingerprint that names their bytes.

A checkpoint path is one ``.safetensors`` file, a directory (every ``*.safetensors`` in it, or
the files its one ``*.safetensors.index.json`` names, which must stay inside the directory), or a
list of files. The fingerprint is built from each file's ``stat`` identity and a hash of its
header, so it changes whenever a file is rewritten, replaced or touched, and checking it costs a
``stat`` per file, never a read of tensor data.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError
from .header import FileIdentity, SafetensorsHeader

#: What a checkpoint path may be: a file, a directory, or a list of files.
CheckpointPath = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]


def checkpoint_files(path: CheckpointPath) -> tuple[list[Path], Path | None]:
    """Resolve ``path`` into checkpoint files, plus the index json that named them (if any).

    Raises CheckpointError when a path does not exist, a directory holds no checkpoint or
    several index files, or an index is invalid or names a file outside its directory.
    """
    if isinstance(path, (list, tuple)):
        files = [Path(p) for p in path]
        if not files:
            raise CheckpointError("the list of checkpoint files is empty: pass at least one .safetensors file")
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"checkpoint file {file} does not exist")
        return files, None
    root = Path(path)  # type: ignore[arg-type]
    if root.is_file():
        return [root], None
    if not root.is_dir():
        raise CheckpointError(
            f"checkpoint path {root} does not exist: pass a .safetensors file, a directory of them, or a list of files"
        )
    indexes = sorted(root.glob("*.safetensors.index.json"))
    if len(indexes) > 1:
        raise CheckpointError(
            f"{root} holds several index files ({', '.join(p.name for p in indexes)}): pass the files of one "
            f"checkpoint as a list, or the directory of one checkpoint"
        )
    if indexes:
        return _indexed_files(root, indexes[0]), indexes[0]
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {root}: pass a directory that holds the checkpoint")
    return files, None


def _indexed_files(root: Path, index: Path) -> list[Path]:
    """The files ``index`` names, each required to exist inside ``root``."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{index} is not a valid safetensors index (needs a weight_map): {exc}") from None
    base = root.resolve()
    files = []
    for name in names:
        file = (root / name).resolve()
        if base not in file.parents:
            raise CheckpointError(
                f"{index} points at {name!r}, outside the checkpoint directory {root}: an index may only "
                f"name files inside its own directory"
            )
        if not file.is_file():
            raise CheckpointError(f"{index} names {name!r}, which does not exist in {root}")
        files.append(file)
    return files


@dataclass(frozen=True)
class CheckpointFiles:
    """One validated reading of a checkpoint: its files, their headers, and their fingerprint."""

    files: list[Path]
    index: Path | None
    index_identity: FileIdentity | None
    headers: list[SafetensorsHeader]
    #: Tensor name -> the header of the first file that holds it.
    where: dict[str, SafetensorsHeader]
    fingerprint: str

    @classmethod
    def read(cls, path: CheckpointPath) -> CheckpointFiles:
        """Resolve ``path``, parse and validate every header (CheckpointError on the first problem)."""
        files, index = checkpoint_files(path)
        headers = [SafetensorsHeader.read(f) for f in files]
        where: dict[str, SafetensorsHeader] = {}
        for header in headers:
            for name in header.entries:
                where.setdefault(name, header)
        digest = hashlib.sha256()
        for header in headers:
            ident = header.identity
            digest.update(
                f"{header.path.resolve()}|{ident.device}|{ident.inode}|{ident.size}|{ident.mtime_ns}|"
                f"{header.digest}\n".encode()
            )
        index_identity = FileIdentity.of(index) if index else None
        return cls(files, index, index_identity, headers, where, digest.hexdigest())

    def changed(self) -> bool:
        """Whether any file (or the index) no longer has the ``stat`` identity it had when read."""
        try:
            if any(FileIdentity.of(h.path) != h.identity for h in self.headers):
                return True
            if self.index is not None and FileIdentity.of(self.index) != self.index_identity:
                return True
        except OSError:
            return True
        return False
