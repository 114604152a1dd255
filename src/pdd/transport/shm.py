"""Same-host KV path: a transfer's blocks through a shared-memory file.

Where P and a decoder run on one host (the local link of a datacenter: P and
RLD in PDD, P and D in pd-local), the bytes need not cross the kernel's
loopback. The sender writes each missing block once into a file on a
memory-backed filesystem (`/dev/shm`); the receiver maps the file and copies
each block straight into its KV pool. The TCP connection still carries the
transfer's frames (BEGIN, HAVE, END, CANCEL, keepalives), with one SEGMENT
naming the file and one small REF per block instead of the block's bytes, so
every failure path stays that of the socket. This is the host's stand-in for
the RDMA-class link of the design: no framing, CRC32, SHA-256 or socket copy
per byte. Measured with `python -m pdd.transport.tls_bench --shm` (README).

No wire lies between the two ends, so blocks in a segment are not sealed: the
receiver hands them to its handler as `kv_codec.LocalBlock`, which it makes
only from a segment it opened itself in its own shm directory, so an unsealed
block can never come off a socket.

The sender owns its files (`SegmentPool`): it keeps a few for the next
transfers once the receiver has acknowledged END (it has copied every block
out), and removes one at once after a failed or cancelled transfer (the
receiver may still be reading it) or when its pool is full; on this machine a
file's first use cost ~4.5 ms of CPU per MB to allocate (a virtual machine's
memory the host had not backed yet), a reused one nothing. A sender that dies
leaves its files; the next sender on the host removes those of dead
processes (`sweep_stale`).

A sender only uses a segment where it has room: the file is allocated
(`posix_fallocate`) before the first block goes, and a directory short of
space (a container's 64 MB /dev/shm) sends that transfer over the socket as
before.
"""

from __future__ import annotations

import ipaddress
import itertools
import mmap
import os
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "pdd-kv-"
# Leave this share of the directory free for the rest of the host.
KEEP_FREE_FRACTION = 0.10
# Files are made in multiples of this, so that one fits the next transfers.
SIZE_STEP = 8 << 20
# What a P makes at start-up (`SegmentPool.warm`): a 2.8K-token prompt of
# SmolLM2 in bf16, the example deployments' longest cold turns.
WARM_SEGMENT_BYTES = 64 << 20

_names = itertools.count()
# Both ends map the file's pages in one go: faulting them in one by one while
# the process's engine thread maps and unmaps its own big buffers (a fresh
# process does, until glibc raises its mmap threshold) waited on the address
# space's lock: P's first same-host copy in a run took ~1 s instead of ~0.06.
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class SegmentError(Exception):
    """A segment the receiver cannot use (wrong place, wrong size, gone)."""


def default_dir() -> Path | None:
    """The host's memory-backed directory, when there is one we may write."""
    return SHM_DIR if SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK | os.X_OK) else None


def is_loopback(host: str) -> bool:
    """The peer is this host (only then can it open our files)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def sweep_stale(directory: Path) -> int:
    """Remove segments left by senders that no longer run; how many."""
    removed = 0
    try:
        names = os.listdir(directory)
    except OSError:
        return 0
    for name in names:
        if not name.startswith(PREFIX):
            continue
        try:
            pid = int(name[len(PREFIX):].split("-")[0])
        except ValueError:
            continue
        if pid == os.getpid() or _alive(pid):
            continue
        try:
            os.unlink(directory / name)
            removed += 1
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class OutSegment:
    """The sender's file for one transfer: `size` bytes, written block by block."""

    def __init__(self, path: Path, size: int, mm: mmap.mmap):
        self.path, self.size, self._mm = path, size, mm

    @classmethod
    def create(cls, size: int, directory: Path) -> "OutSegment | None":
        """A file of `size` bytes, its memory reserved; None when the directory
        lacks room (or cannot be written): the caller sends over the socket."""
        if size <= 0:
            return None
        try:
            st = os.statvfs(directory)
        except OSError:
            return None
        if st.f_bavail * st.f_frsize - size < KEEP_FREE_FRACTION * st.f_blocks * st.f_frsize:
            return None
        path = directory / f"{PREFIX}{os.getpid()}-{next(_names)}"
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None
        try:
            # Reserved now: writing into a mapping of a full tmpfs would kill
            # the process with SIGBUS instead of failing.
            os.posix_fallocate(fd, 0, size)
            mm = mmap.mmap(fd, size, flags=_MAP_FLAGS)
        except OSError:
            os.close(fd)
            _unlink(path)
            return None
        os.close(fd)
        return cls(path, size, mm)

    def prefault(self) -> None:
        """Touch every page once (a kept file's pages then cost nothing)."""
        step = mmap.PAGESIZE
        for off in range(0, self.size, step):
            self._mm[off] = 0

    def write(self, offset: int, data) -> None:
        n = len(data)
        if offset < 0 or offset + n > self.size:
            raise ValueError(f"{n} bytes at {offset} overrun a segment of {self.size}")
        self._mm[offset:offset + n] = data

    def slot(self, offset: int, n: int) -> memoryview:
        """A writable view of [offset, offset + n), for a reader that writes a
        block straight into place (release it before `close`)."""
        if offset < 0 or offset + n > self.size:
            raise ValueError(f"{n} bytes at {offset} overrun a segment of {self.size}")
        return memoryview(self._mm)[offset:offset + n]

    def close(self) -> None:
        """Unmap and unlink (the receiver's mapping, if any, stays valid)."""
        if self._mm is not None:
            self._mm.close()
            self._mm = None
        _unlink(self.path)


class InSegment:
    """The receiver's read-only mapping of a sender's segment."""

    def __init__(self, size: int, mm: mmap.mmap):
        self.size = size
        self._mm = mm
        self._view = memoryview(mm)

    @classmethod
    def open(cls, path: str, size: int, directory: Path | None) -> "InSegment":
        """Map the file the sender named (the sender owns it). Only a file of
        ours in our own shm directory: a name elsewhere is refused."""
        if directory is None:
            raise SegmentError("this receiver takes no shared-memory segments (no shm directory)")
        p = Path(path)
        if p.parent != directory or not p.name.startswith(PREFIX) or p.is_symlink():
            raise SegmentError(f"segment {path!r} is not a {PREFIX}* file in {directory}")
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as e:
            raise SegmentError(f"cannot open segment {path!r}: {e.strerror or e}") from None
        try:
            st = os.fstat(fd)
            if st.st_size < size or size <= 0:
                raise SegmentError(f"segment {path!r} holds {st.st_size} bytes, {size} announced")
            mm = mmap.mmap(fd, size, flags=_MAP_FLAGS, prot=mmap.PROT_READ)
        except OSError as e:
            raise SegmentError(f"cannot map segment {path!r}: {e.strerror or e}") from None
        finally:
            os.close(fd)
        return cls(size, mm)

    def block(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length <= 0 or offset + length > self.size:
            raise SegmentError(f"{length} bytes at {offset} lie outside the segment of {self.size}")
        return self._view[offset:offset + length]

    def close(self) -> None:
        """Drop the mapping; a block view a handler still holds keeps it alive
        until it goes (then the memory returns to the host)."""
        self._view.release()
        try:
            self._mm.close()
        except BufferError:
            pass


class SegmentPool:
    """A sender's files: taken for a transfer, given back after it."""

    def __init__(self, directory: Path, max_idle: int = 2, max_idle_bytes: int = 256 << 20):
        self.directory = directory
        self.max_idle, self.max_idle_bytes = max_idle, max_idle_bytes
        self._idle: list[OutSegment] = []
        self.num_created = 0
        self.num_reused = 0

    def take(self, size: int) -> OutSegment | None:
        """A file of at least `size` bytes (a kept one if one fits), or None."""
        fits = [s for s in self._idle if s.size >= size]
        if fits:
            seg = min(fits, key=lambda s: s.size)
            self._idle.remove(seg)
            self.num_reused += 1
            return seg
        seg = OutSegment.create(-(-size // SIZE_STEP) * SIZE_STEP, self.directory)
        if seg is None and self._idle:              # room taken by kept files: free them, try again
            self.clear()
            seg = OutSegment.create(-(-size // SIZE_STEP) * SIZE_STEP, self.directory)
        self.num_created += seg is not None
        return seg

    def give_back(self, seg: OutSegment, reusable: bool) -> None:
        """After the transfer: kept only if it ended well (the receiver has
        copied every block out) and the pool has room."""
        if (reusable and len(self._idle) < self.max_idle
                and sum(s.size for s in self._idle) + seg.size <= self.max_idle_bytes):
            self._idle.append(seg)
        else:
            seg.close()

    def warm(self, size: int) -> None:
        """Make (and keep) one file now, so that the first transfer does not
        pay for its memory."""
        seg = self.take(size)
        if seg is not None:
            seg.prefault()
            self.give_back(seg, True)

    def clear(self) -> None:
        for seg in self._idle:
            seg.close()
        self._idle.clear()


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
