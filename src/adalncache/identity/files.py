"""File identity: what says a file on disk is still the one that was read.

Two records, for two questions. :class:`FileIdentity` is the ``stat`` identity a source and a
table file re-check at the start of every pass and lookup (cheap, never a re-hash).
:class:`FileStamp` adds the host, the resolved path and the header's hash: it is the key the digest
memo (:mod:`adalncache.identity.memo`) remembers a file's content digest under, so that a copy on
another host or path costs one hashing read instead of trusting a digest it never computed.
"""

from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..canonical import canonical_json


@dataclass(frozen=True)
class FileIdentity:
    """``stat`` identity of a file: any rewrite, rename-replace or touch changes it.

    The change time is part of it because the modification time is not enough: a rewrite in place
    that puts the mtime back (``os.utime``, ``touch -d``, a copy tool that preserves times) keeps
    device, inode, size and mtime, but every write, ``utime`` and ``chmod`` sets the ctime to the
    current time, and no user can set it back.
    """

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: Path) -> FileIdentity:
        return cls.from_stat(os.stat(path))

    @classmethod
    def from_stat(cls, st: os.stat_result) -> FileIdentity:
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True)
class FileStamp:
    """Everything that says a file still holds the bytes it held when it was hashed.

    The stat identity plus ``ctime``: a rewrite that restores the mtime (``touch -d``, ``os.utime``)
    still changes the ctime, which no user can set. The host and the resolved path make a copy a
    new identity (it costs one hashing read, never a wrong digest). ``header`` is the sha256 of
    the file's safetensors header.
    """

    host: str
    path: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    header: str

    @classmethod
    def of(cls, path: Path, header: str) -> FileStamp:
        st = os.stat(path)
        return cls(
            socket.gethostname(),
            str(Path(path).resolve()),
            st.st_dev,
            st.st_ino,
            st.st_size,
            st.st_mtime_ns,
            st.st_ctime_ns,
            header,
        )

    def as_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "path": self.path,
            "device": self.device,
            "inode": self.inode,
            "size": self.size,
            "mtime_ns": self.mtime_ns,
            "ctime_ns": self.ctime_ns,
            "header": self.header,
        }

    @property
    def key(self) -> str:
        """The memo's name for this identity (the record itself is compared in full)."""
        return hashlib.sha256(canonical_json(self.as_json())).hexdigest()[:32]


__all__ = ["FileIdentity", "FileStamp"]
