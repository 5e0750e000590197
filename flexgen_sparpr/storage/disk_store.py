"""The disk tier's directory: a `DiskStore` owns the directory of one run and the `DiskFile`s in
it (storage/disk.py), records its owner there (storage/leftovers.py) and removes it on close (or at
interpreter exit); its readers keep several reads in flight. `disk_bandwidth` measures a folder."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .disk import DiskFile, aligned_empty, round_up
from .leftovers import write_owner

class DiskStore:
    """The directory of one run (`root/run-<pid>-<random>`) and the files in it. `read_depth`
    reads may be in flight at once (`map`): a disk answers several outstanding requests faster
    than one at a time (measured on this project's VM disk: 1.4 GB/s at depth 1, 2.2 at 4)."""

    def __init__(self, root: Path, direct: bool = False, read_depth: int = 4):
        root = Path(root)
        self.direct = direct
        self.read_depth = max(1, read_depth)
        self._readers: ThreadPoolExecutor | None = None
        self.created_root = not root.exists()  # then removed at close when empty
        if self.created_root:
            try:
                root.mkdir(parents=True)
            except FileExistsError:  # another run (a pipeline's other rank) made it meanwhile
                pass
            except OSError as e:
                raise ValueError(f"cannot create offload directory {root}: {e.strerror}.") from None
        if not root.is_dir() or not os.access(root, os.W_OK | os.X_OK):
            raise ValueError(f"offload directory {root} is not a writable directory.")
        self.root = root
        try:
            self.dir = Path(tempfile.mkdtemp(prefix=f"run-{os.getpid()}-", dir=root))
        except OSError as e:
            raise ValueError(f"cannot write to offload directory {root}: {e.strerror}.") from None
        try:  # who owns the folder, so a later run can tell it was left by a dead one
            write_owner(self.dir)
        except OSError:
            shutil.rmtree(self.dir, ignore_errors=True)
            raise
        self.files: dict[str, DiskFile] = {}
        self._lock = threading.Lock()
        self._closed = False
        atexit.register(self.close)

    def new_file(self, name: str, num_slots: int, slot_bytes: int, packed: bool = False) -> DiskFile:
        """Create the slot file `name` inside this run's directory (`packed`: see DiskFile)."""
        if not name or os.sep in name or name in (".", ".."):
            raise ValueError(f"file name must be a plain name, got {name!r}")
        with self._lock:
            if self._closed:
                raise ValueError("DiskStore is closed")
            if name in self.files:
                raise ValueError(f"file {name!r} already exists in {self.dir}")
            f = DiskFile(self.dir / name, num_slots, slot_bytes, direct=self.direct, packed=packed)
            self.files[name] = f
            return f

    def map(self, fn, items: list) -> list:
        """fn over items, up to read_depth at once (in order; inline for one item)."""
        if self.read_depth == 1 or len(items) <= 1:
            return [fn(x) for x in items]
        with self._lock:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(self.read_depth, thread_name_prefix="flexgen-disk",
                                                   initializer=torch.set_num_threads, initargs=(1,))
            pool = self._readers
        return list(pool.map(fn, items))

    def close(self) -> None:
        """Close every file and remove the run directory; safe to call twice."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            files, self.files = list(self.files.values()), {}
            readers, self._readers = self._readers, None
        if readers is not None:
            readers.shutdown(wait=True)
        for f in files:
            f.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.created_root:
            try:
                self.root.rmdir()  # only succeeds when empty
            except OSError:
                pass
        atexit.unregister(self.close)

    def __enter__(self) -> "DiskStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def disk_bandwidth(dir: Path, nbytes: int = 64 << 20, direct: bool = True,
                   chunk_bytes: int = 8 << 20) -> dict:
    """Sequential write (incl. fsync) then read of an `nbytes` temp file in `dir`.

    Returns {"read_GBps", "write_GBps", "mode"}; the file is deleted afterwards.
    """
    chunk_bytes = min(round_up(chunk_bytes), round_up(nbytes))
    n_chunks = max(1, -(-nbytes // chunk_bytes))
    src = aligned_empty((chunk_bytes,), torch.uint8)
    src.copy_(torch.randint(0, 256, (chunk_bytes,), dtype=torch.uint8))  # incompressible
    store = DiskStore(Path(dir), direct=direct)
    try:
        f = store.new_file("bandwidth.bin", n_chunks, chunk_bytes)
        t0 = time.perf_counter()
        for i in range(n_chunks):
            f.write(i, src)
        f.sync()
        t1 = time.perf_counter()
        for i in range(n_chunks):
            f.read(i, src)
        t2 = time.perf_counter()
        total = n_chunks * chunk_bytes
        return {"read_GBps": total / (t2 - t1) / 1e9,
                "write_GBps": total / (t1 - t0) / 1e9,
                "mode": f.direct_mode}
    finally:
        store.close()
