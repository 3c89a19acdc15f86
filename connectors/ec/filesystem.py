"""Filesystem EC store: one file per entry under <root>/<key[:2]>/<key>.ec.

Invariants:
- A final entry file is only ever created whole: bytes go to a temp file in the
  same directory, which is then hard-linked (or, without hard links, renamed)
  into place. Readers never see a partial file.
- os.link fails if the target exists, so of several concurrent producers of one
  key (any number of processes) exactly one put returns True.
- mtime is the LRU clock: put and get set it with time.time_ns(), not the
  kernel's coarse file clock, so close accesses still order correctly.
- The byte budget is enforced by scanning the directory after each new put, so
  it holds across processes sharing one root (concurrent evictors may over-evict
  slightly, never under-evict).
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from connectors.ec.base import ECCorruptEntryError, ECEntry, ECStats, ECStore, validate_key
from connectors.ec.codec import decode_entry, encode_parts, payload_nbytes

_SUFFIX = ".ec"
_TMP_PREFIX = ".tmp-"
_STALE_TMP_S = 3600  # temp files older than this belong to a crashed writer


@dataclass(frozen=True)
class _FileInfo:
    path: Path
    size: int
    mtime_ns: int


def _touch(path: Path) -> None:
    now = time.time_ns()
    os.utime(path, ns=(now, now))


class FilesystemECStore(ECStore):
    def __init__(self, root: str | Path, max_bytes: int) -> None:
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)

    def path_for(self, key: str) -> Path:
        """File holding key's entry (for diagnostics and tests)."""
        validate_key(key)
        return self.root / key[:2] / (key + _SUFFIX)

    # -- producer -------------------------------------------------------------

    def put(self, key: str, tensor: torch.Tensor, meta: Mapping[str, str] | None = None) -> bool:
        path = self.path_for(key)
        self._check_size(key, payload_nbytes(tensor))  # before encoding copies it
        prefix, payload = encode_parts(tensor, meta)
        self._check_size(key, len(prefix) + len(payload))
        if path.exists():
            self._try_touch(path)
            return False
        path.parent.mkdir(exist_ok=True)
        created = self._publish(path, prefix, payload)
        if created:
            self._evict(keep=path)
        return created

    def _check_size(self, key: str, size: int) -> None:
        if size > self.max_bytes:
            raise ValueError(f"EC entry {key!r} is {size} bytes, larger than max_bytes={self.max_bytes}")

    def _publish(self, path: Path, prefix: bytes, payload: memoryview) -> bool:
        tmp = path.parent / f"{_TMP_PREFIX}{path.name}.{os.getpid()}.{uuid.uuid4().hex}"
        try:
            with open(tmp, "xb") as f:
                f.write(prefix)
                f.write(payload)
            _touch(tmp)
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                self._try_touch(path)
                return False
            except OSError:  # no hard links on this filesystem: rename is still atomic
                if path.exists():
                    return False
                os.replace(tmp, path)
                return True
        finally:
            tmp.unlink(missing_ok=True)

    # -- consumer -------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.path_for(key).is_file()

    def get(self, key: str) -> ECEntry | None:
        path = self.path_for(key)
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                buf = f.read()
        except FileNotFoundError:
            return None
        try:
            entry = decode_entry(buf)
        except ECCorruptEntryError as e:
            self._remove_if_same(path, st)
            raise ECCorruptEntryError(f"EC entry {key!r} at {path}: {e}") from None
        self._try_touch(path)
        return entry

    # -- store ----------------------------------------------------------------

    def delete(self, key: str) -> bool:
        try:
            self.path_for(key).unlink()
            return True
        except FileNotFoundError:
            return False

    def stats(self) -> ECStats:
        files = self._scan()
        return ECStats(bytes_used=sum(f.size for f in files), entries=len(files))

    def close(self) -> None:
        pass

    # -- internals ------------------------------------------------------------

    @staticmethod
    def _try_touch(path: Path) -> None:
        try:
            _touch(path)
        except FileNotFoundError:  # evicted concurrently
            pass

    @staticmethod
    def _remove_if_same(path: Path, st: os.stat_result) -> None:
        """Unlink path only if it is still the inode we read (not a fresh re-publish)."""
        try:
            cur = path.stat()
            if (cur.st_ino, cur.st_dev) == (st.st_ino, st.st_dev):
                path.unlink()
        except FileNotFoundError:
            pass

    def _scan(self) -> list[_FileInfo]:
        files: list[_FileInfo] = []
        stale_before = time.time() - _STALE_TMP_S
        for shard in os.scandir(self.root):
            if not shard.is_dir(follow_symlinks=False):
                continue
            for e in os.scandir(shard.path):
                try:
                    st = e.stat(follow_symlinks=False)
                    if e.name.endswith(_SUFFIX) and not e.name.startswith(_TMP_PREFIX):
                        files.append(_FileInfo(Path(e.path), st.st_size, st.st_mtime_ns))
                    elif e.name.startswith(_TMP_PREFIX) and st.st_mtime < stale_before:
                        os.unlink(e.path)
                except FileNotFoundError:  # removed by another process mid-scan
                    continue
        return files

    def _evict(self, keep: Path) -> None:
        files = self._scan()
        total = sum(f.size for f in files)
        if total <= self.max_bytes:
            return
        # Oldest first; the entry just written goes last.
        for f in sorted(files, key=lambda f: (f.path == keep, f.mtime_ns, f.path.name)):
            if total <= self.max_bytes:
                break
            f.path.unlink(missing_ok=True)
            total -= f.size
