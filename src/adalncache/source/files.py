"""Which files make a checkpoint, their parsed headers, and the fingerprint that names their bytes.

A checkpoint path is one ``.safetensors`` file, an index (``*.safetensors.index.json``), a
directory, or a list of files. A directory stands for exactly one set of files, the one diffusers
would load from it, chosen in this order:

1. its one ``*.safetensors.index.json`` (diffusers' sharded layout, or a native index): the files
   it names, which must stay inside the directory;
2. diffusers' single weights file, ``diffusion_pytorch_model.safetensors``;
3. otherwise every ``*.safetensors`` in it.

Any other ``*.safetensors`` in the directory that holds a tensor name of that set (an old copy
of the weights, another precision's variant) makes the directory ambiguous: it is refused with a
``CheckpointError`` naming both files, never merged and never silently ignored, because the
cache must serve the weights the model loads. Other files (a LoRA, other tensor names) are not
read. A tensor name given by two files of the set is refused the same way (alignment padding that
:func:`~adalncache.source.writer.write_safetensors` inserts is no tensor and may repeat).

Only regular files are ever opened: a FIFO, a device or a socket named ``*.safetensors`` is
skipped in a directory (logged) and refused when named itself, so nothing blocks.

The fingerprint is built from each file's ``stat`` identity (device, inode, size, mtime, ctime)
and a hash of its header, so it changes whenever a file is rewritten (even with its mtime put
back), replaced or touched, and checking it costs a ``stat`` per file, never a read of tensor data.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from ..errors import CheckpointError
from ..identity.files import FileIdentity
from ..options import flag
from .header import SafetensorsHeader, is_regular
from .writer import PAD_PREFIX

log = logging.getLogger(__name__)

#: What a checkpoint path may be: a file, an index, a directory, or a list of files.
CheckpointPath = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]

#: The single weights file diffusers' ``from_pretrained`` loads from a model directory.
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
INDEX_SUFFIX = ".safetensors.index.json"

#: How a user picks one file set: the library argument and every command-line way to pass a checkpoint.
PICK = (
    "pass the file (or the index) to serve from: CheckpointSource(path), the checkpoint= of an integration, "
    f"the CHECKPOINT argument of adalncache build, export and inspect, or {flag('checkpoint')} of adalncache verify"
)


def _not_regular(path: Path) -> CheckpointError:
    return CheckpointError(
        f"checkpoint file {path} is not a regular file (a FIFO, a device, a socket or a directory): pass a "
        f".safetensors file"
    )


def _regular_in(root: Path, pattern: str) -> list[Path]:
    """The regular files of ``root`` matching ``pattern``, sorted; anything else is skipped (logged), never opened."""
    out = []
    for path in sorted(root.glob(pattern)):
        if is_regular(path):
            out.append(path)
        elif path.exists() or path.is_symlink():
            log.warning("%s is not a regular file (a FIFO, a device or a socket?): not read", path)
    return out


def checkpoint_files(path: CheckpointPath) -> tuple[list[Path], Path | None]:
    """Resolve ``path`` into checkpoint files, plus the index json that named them (if any).

    Raises CheckpointError when a path does not exist or is not a regular file, a directory holds
    no checkpoint or several index files, or an index is invalid or names a file outside its
    directory. (Ambiguity with other files of a directory is checked by :class:`CheckpointFiles`,
    which reads their headers.)
    """
    if isinstance(path, (list, tuple)):
        files = [Path(p) for p in path]
        if not files:
            raise CheckpointError("the list of checkpoint files is empty: pass at least one .safetensors file")
        for file in files:
            if not file.exists():
                raise CheckpointError(f"checkpoint file {file} does not exist")
            if not is_regular(file):
                raise _not_regular(file)
        return files, None
    root = Path(cast("str | os.PathLike[str]", path))  # a list or tuple returned above
    try:
        mode = os.stat(root).st_mode
    except FileNotFoundError:
        raise CheckpointError(
            f"checkpoint path {root} does not exist: pass a .safetensors file, a directory of them, or a list of files"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot use checkpoint path {root}: {exc}") from exc
    if stat.S_ISREG(mode):
        if root.name.endswith(INDEX_SUFFIX):
            return _indexed_files(root.parent, root), root
        return [root], None
    if not stat.S_ISDIR(mode):
        raise _not_regular(root)
    indexes = _regular_in(root, "*" + INDEX_SUFFIX)
    if len(indexes) > 1:
        raise CheckpointError(
            f"{root} holds several index files ({', '.join(p.name for p in indexes)}): pass the index to use "
            f"(its path), the files of one checkpoint as a list, or the directory of one checkpoint"
        )
    if indexes:
        return _indexed_files(root, indexes[0]), indexes[0]
    files = _regular_in(root, "*.safetensors")
    if not files:
        raise CheckpointError(f"no *.safetensors files in {root}: pass a directory that holds the checkpoint")
    single = root / DIFFUSERS_WEIGHTS
    if single in files:
        return [single], None
    return files, None


def other_files(path: CheckpointPath, files: Sequence[Path]) -> list[Path]:
    """The regular ``*.safetensors`` of directory ``path`` that are not among ``files`` (none for a file or list)."""
    if isinstance(path, (list, tuple)):
        return []
    root = Path(cast("str | os.PathLike[str]", path))  # a list or tuple returned above
    if not root.is_dir():
        return []
    chosen = {f.resolve() for f in files}
    return [f for f in _regular_in(root, "*.safetensors") if f.resolve() not in chosen]


def _indexed_files(root: Path, index: Path) -> list[Path]:
    """The files ``index`` names, each required to be a regular file inside ``root``."""
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{index} is not a valid safetensors index (needs a weight_map): {exc}") from None
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in weight_map.items())
    ):
        raise CheckpointError(
            f"{index} is not a valid safetensors index: its weight_map must map tensor names to file names "
            f"(strings), got {json.dumps(weight_map)[:120]}"
        )
    base = root.resolve()
    files = []
    for name in sorted(set(weight_map.values())):
        file = (root / name).resolve()
        if base not in file.parents:
            raise CheckpointError(
                f"{index} points at {name!r}, outside the checkpoint directory {root}: an index may only "
                f"name files inside its own directory"
            )
        if not file.exists():
            raise CheckpointError(f"{index} names {name!r}, which does not exist in {root}")
        if not is_regular(file):
            raise _not_regular(file)
        files.append(file)
    return files


def _clash(root: Path, name: str, first: Path, second: Path, index: Path | None) -> CheckpointError:
    chosen = f"its index {index.name} names {first.name}" if index is not None else f"{first.name} is read"
    return CheckpointError(
        f"{root} is ambiguous: {first.name} and {second.name} both hold tensor {name!r} ({chosen}); a checkpoint "
        f"is one set of files, never a merge: {PICK}, or move the other file out of the directory"
    )


@dataclass(frozen=True)
class CheckpointFiles:
    """One validated reading of a checkpoint: its files, their headers, and their fingerprint."""

    files: list[Path]
    index: Path | None
    index_identity: FileIdentity | None
    headers: list[SafetensorsHeader]
    #: Tensor name -> the header of the file that holds it.
    where: dict[str, SafetensorsHeader]
    fingerprint: str

    @classmethod
    def read(cls, path: CheckpointPath) -> CheckpointFiles:
        """Resolve ``path``, parse and validate every header (CheckpointError on the first problem)."""
        files, index = checkpoint_files(path)
        headers = [SafetensorsHeader.read(f) for f in files]
        where: dict[str, SafetensorsHeader] = {}
        root = index.parent if index is not None else files[0].parent if len(files) > 1 else Path(str(files[0]))
        if isinstance(path, (str, os.PathLike)) and Path(path).is_dir():
            root = Path(path)
        for header in headers:
            for name in header.entries:
                held = where.setdefault(name, header)
                if held is not header and not name.startswith(PAD_PREFIX):
                    raise _clash(root, name, held.path, header.path, index)
        for other in other_files(path, files):
            try:
                names = SafetensorsHeader.read(other).entries
            except CheckpointError as exc:
                log.warning("%s is not part of the checkpoint and cannot be read (%s): ignored", other, exc)
                continue
            shared = sorted(n for n in set(names) & set(where) if not n.startswith(PAD_PREFIX))
            if shared:
                raise _clash(root, shared[0], where[shared[0]].path, other, index)
            log.info("%s holds none of the checkpoint's tensors: not read", other)
        digest = hashlib.sha256()
        for header in headers:
            ident = header.identity
            digest.update(
                f"{header.path.resolve()}|{ident.device}|{ident.inode}|{ident.size}|{ident.mtime_ns}|"
                f"{ident.ctime_ns}|{header.digest}\n".encode()
            )
        index_identity = FileIdentity.of(index) if index else None
        return cls(files, index, index_identity, headers, where, digest.hexdigest())

    def changed_files(self) -> list[Path]:
        """The files (and index) whose ``stat`` identity is no longer the one they had when read."""
        out = []
        watched = [(h.path, h.identity) for h in self.headers]
        if self.index is not None and self.index_identity is not None:
            watched.append((self.index, self.index_identity))
        for path, identity in watched:
            try:
                if FileIdentity.of(path) != identity:
                    out.append(path)
            except OSError:
                out.append(path)
        return out

    def changed(self) -> bool:
        """Whether any file (or the index) no longer has the ``stat`` identity it had when read."""
        return bool(self.changed_files())


__all__ = ["DIFFUSERS_WEIGHTS", "CheckpointFiles", "CheckpointPath", "checkpoint_files", "other_files"]
