"""Tests for the disk tier: slot files, run directories, bandwidth probe."""

import errno
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from flexgen_sparpr.storage import disk
from flexgen_sparpr.storage.disk import DiskFile, aligned_empty
from flexgen_sparpr.storage.disk_store import DiskStore, disk_bandwidth

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool]
SHAPES = [(1,), (3, 5, 7), (1024,), (2, 4096)]  # (1024,) f32 / (2, 4096) hit the aligned fast path
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rand(shape, dtype, device="cpu"):
    if dtype == torch.bool:
        return torch.rand(shape, device=device) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, device=device).to(dtype)
    return torch.randint(-100, 100, shape, device=device).to(dtype)


def _o_direct_works(d: Path) -> bool:
    """Independent probe: can this filesystem do an aligned O_DIRECT write?"""
    if not hasattr(os, "O_DIRECT"):
        return False
    p = d / "probe"
    try:
        fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    try:
        os.pwritev(fd, [mmap.mmap(-1, 4096)], 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        p.unlink()


@pytest.fixture
def real_dir(tmp_path):
    """A directory on a disk-backed filesystem (/var/tmp) when possible, else tmp_path."""
    try:
        d = Path(tempfile.mkdtemp(prefix="fgsp-test-", dir="/var/tmp"))
    except OSError:
        yield tmp_path
        return
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def no_o_direct(monkeypatch):
    """Make every O_DIRECT open fail with EINVAL, as tmpfs on older kernels does."""
    real_open = os.open

    def fake_open(path, flags, *args, **kw):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(disk.os, "open", fake_open)


@pytest.mark.parametrize("direct", [False, True])
def test_round_trip_all_dtypes_and_shapes(tmp_path, direct):
    cases = [(s, d) for s in SHAPES for d in DTYPES]
    slot_bytes = max(torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for s, d in cases)
    written = [_rand(s, d) for s, d in cases]
    with DiskFile(tmp_path / "f.bin", len(cases), slot_bytes, direct=direct) as f:
        assert f.direct_mode in (("o_direct", "fadvise") if direct else ("buffered",))
        for i, t in enumerate(written):
            f.write(i, t)
        for i in reversed(range(len(cases))):  # read back out of order
            t = written[i]
            assert torch.equal(f.read_new(i, t.shape, t.dtype), t)
            out = torch.empty_like(t)
            assert torch.equal(f.read(i, out), t)
        payload = sum(t.nbytes for t in written)
        assert f.bytes_written == payload and f.bytes_read == 2 * payload
    assert not (tmp_path / "f.bin").exists()


def test_slot_stride_is_aligned_and_file_preallocated(tmp_path):
    with DiskFile(tmp_path / "f.bin", 3, 5000) as f:
        assert f.slot_stride == 8192
        assert os.path.getsize(f.path) == 3 * 8192


def test_aligned_empty_is_page_aligned():
    for shape in [(5,), (3, 4096), ()]:
        t = aligned_empty(shape, torch.float16)
        assert t.shape == torch.Size(shape) and t.dtype == torch.float16
        assert t.data_ptr() % 4096 == 0


def test_o_direct_on_real_filesystem(real_dir):
    if not _o_direct_works(real_dir):
        pytest.skip(f"{real_dir} refuses O_DIRECT")
    t = _rand((3, 1000), torch.float16)  # 6000 bytes: unaligned size goes through staging
    with DiskFile(real_dir / "f.bin", 2, t.nbytes, direct=True) as f:
        assert f.direct_mode == "o_direct"
        f.write(1, t)
        assert torch.equal(f.read_new(1, t.shape, t.dtype), t)
        assert torch.equal(f.read(1, torch.empty_like(t)), t)  # unaligned out
        a = aligned_empty((2048,), torch.float16)  # 4096 bytes, aligned: zero-copy path
        a.copy_(_rand((2048,), torch.float16))
        f.write(0, a)
        assert torch.equal(f.read_new(0, a.shape, a.dtype), a)
        assert f.bytes_written == t.nbytes + a.nbytes


@pytest.mark.parametrize("direct", [False, True])
def test_a_span_of_page_padded_slots_reads_in_one_request(real_dir, direct):
    """Slots padded to whole pages (O_DIRECT and a size that is not one: an encoded KV block) read
    as one span: the padding comes along and each slot's bytes land one after the other."""
    if direct and not _o_direct_works(real_dir):
        pytest.skip(f"{real_dir} refuses O_DIRECT")
    parts = [_rand((3, 1152), torch.float16) for _ in range(4)]  # 6912 bytes a slot, as a q8 KV block
    with DiskFile(real_dir / "f.bin", 5, parts[0].nbytes, direct=direct) as f:
        for i, t in enumerate(parts):
            f.write(i + 1, t)
        assert not f.is_packed  # each slot starts on a page
        out = torch.empty(4, 3, 1152, dtype=torch.float16)
        f.read_slots(1, 4, out)
        assert all(torch.equal(out[i], parts[i]) for i in range(4))
        with pytest.raises(ValueError, match="holds"):
            f.read_slots(0, 2, out[:2])  # slot 0 was never written


def test_fadvise_fallback_when_o_direct_refused(tmp_path, no_o_direct):
    t = _rand((7, 9), torch.bfloat16)
    with DiskFile(tmp_path / "f.bin", 2, t.nbytes, direct=True) as f:
        assert f.direct_mode == "fadvise"
        f.write(0, t)
        assert torch.equal(f.read_new(0, t.shape, t.dtype), t)


def test_failed_preallocation_leaves_no_file(tmp_path, monkeypatch):
    def no_space(fd, off, n):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk.os, "posix_fallocate", no_space)
    with pytest.raises(OSError, match="No space"):
        DiskFile(tmp_path / "f.bin", 4, 4096)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("direct", [False, True])
def test_concurrent_reads_and_writes(real_dir, direct):
    tensors = [_rand((257 + i, 33), torch.float16) for i in range(24)]
    slot_bytes = max(t.nbytes for t in tensors)
    with DiskFile(real_dir / "f.bin", len(tensors), slot_bytes, direct=direct) as f:
        with ThreadPoolExecutor(max_workers=8) as pool:
            list(pool.map(f.write, range(len(tensors)), tensors))
            got = list(pool.map(lambda i: f.read_new(i, tensors[i].shape, tensors[i].dtype),
                                [i for i in range(len(tensors))] * 3))
        for k, g in enumerate(got):
            assert torch.equal(g, tensors[k % len(tensors)])
        assert f.bytes_read == 3 * sum(t.nbytes for t in tensors)


def test_rewrite_slot_with_different_size(tmp_path):
    with DiskFile(tmp_path / "f.bin", 1, 4000, direct=True) as f:
        f.write(0, torch.arange(1000, dtype=torch.int32))
        small = torch.arange(10, dtype=torch.int16)
        f.write(0, small)
        assert torch.equal(f.read_new(0, (10,), torch.int16), small)


def test_errors(tmp_path):
    with DiskFile(tmp_path / "f.bin", 2, 64) as f:
        with pytest.raises(IndexError):
            f.write(2, torch.zeros(4))
        with pytest.raises(ValueError, match="do not fit"):
            f.write(0, torch.zeros(17))
        with pytest.raises(ValueError, match="contiguous"):
            f.write(0, torch.zeros(4, 4).t())
        with pytest.raises(ValueError, match="holds -1 bytes"):
            f.read(1, torch.empty(4))  # never written
        f.write(0, torch.zeros(4))
        with pytest.raises(ValueError, match="holds 16 bytes"):
            f.read(0, torch.empty(3))
        f.close()
        f.close()  # idempotent
        with pytest.raises(ValueError, match="closed"):
            f.write(0, torch.zeros(4))


@CUDA
@pytest.mark.parametrize("direct", [False, True])
def test_cuda_round_trip(tmp_path, direct):
    t = _rand((33, 65), torch.bfloat16, device="cuda")
    with DiskFile(tmp_path / "f.bin", 1, t.nbytes, direct=direct) as f:
        f.write(0, t)
        out = torch.empty_like(t)
        assert torch.equal(f.read(0, out), t)
        assert torch.equal(f.read_new(0, t.shape, t.dtype), t.cpu())


def test_store_close_leaves_nothing(tmp_path):
    root = tmp_path / "new" / "offload"
    store = DiskStore(root, direct=True)
    assert store.dir.parent == root and store.dir.name.startswith(f"run-{os.getpid()}-")
    a = store.new_file("weights.bin", 4, 1 << 12)
    b = store.new_file("kv.bin", 2, 100)
    a.write(3, torch.ones(1024))
    b.write(1, torch.ones(25))
    assert sorted(p.name for p in store.dir.iterdir()) == ["kv.bin", "owner.json", "weights.bin"]
    store.close()
    store.close()
    assert not root.exists()  # root was created by the store, so it goes too
    assert (tmp_path / "new").exists()


def test_store_keeps_existing_root(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    with DiskStore(tmp_path, direct=False) as store:
        store.new_file("a.bin", 1, 10)
        with pytest.raises(ValueError, match="already exists"):
            store.new_file("a.bin", 1, 10)
        with pytest.raises(ValueError, match="plain name"):
            store.new_file("../a.bin", 1, 10)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_two_stores_share_a_root(tmp_path):
    with DiskStore(tmp_path) as s1, DiskStore(tmp_path) as s2:
        assert s1.dir != s2.dir
    assert list(tmp_path.iterdir()) == []


def test_unwritable_root_raises_value_error(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match="not a writable directory"):
        DiskStore(not_a_dir)
    with pytest.raises(ValueError, match="cannot create"):
        DiskStore(not_a_dir / "sub")


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write into read-only directories")
def test_read_only_root_raises_value_error(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(ValueError, match="not a writable directory"):
        DiskStore(ro)


def test_atexit_cleans_up_after_crash(tmp_path):
    code = (
        "import sys, torch\n"
        "from flexgen_sparpr.storage.disk_store import DiskStore\n"
        "s = DiskStore(sys.argv[1], direct=True)\n"
        "s.new_file('w.bin', 2, 4096).write(0, torch.ones(1024))\n"
        "raise RuntimeError('boom')\n"
    )
    root = tmp_path / "root"
    repo = Path(disk.__file__).resolve().parents[2]  # the package may not be installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, env=env)
    assert r.returncode != 0 and "boom" in r.stderr
    assert not root.exists()


def test_disk_bandwidth_reports_and_cleans_up(tmp_path):
    res = disk_bandwidth(tmp_path, nbytes=1 << 20, direct=True, chunk_bytes=256 << 10)
    assert set(res) == {"read_GBps", "write_GBps", "mode"}
    assert res["read_GBps"] > 0 and res["write_GBps"] > 0
    assert res["mode"] in ("o_direct", "fadvise")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("direct", [False, True])
def test_read_at_reads_part_of_a_slot(real_dir, direct):
    if direct and not _o_direct_works(real_dir):
        pytest.skip(f"{real_dir} refuses O_DIRECT")
    t = _rand((3, 2048), torch.float16)  # three 4096-byte rows
    with DiskFile(real_dir / "f.bin", 2, t.nbytes, direct=direct) as f:
        f.write(1, t)
        assert torch.equal(f.read_at(1, 4096, torch.empty(2, 2048, dtype=torch.float16)), t[1:])
        assert torch.equal(f.read_at(1, 0, aligned_empty((2048,), torch.float16)), t[0])
        with pytest.raises(ValueError, match="outside"):
            f.read_at(1, 8192, torch.empty(2, 2048, dtype=torch.float16))
        # anywhere (O_DIRECT: the pages around the bytes, through the staging buffer), across a page too
        assert torch.equal(f.read_at(1, 2, torch.empty(3, dtype=torch.float16)), t[0, 1:4])
        assert torch.equal(f.read_at(1, 4094, torch.empty(5, dtype=torch.float16)), t.reshape(-1)[2047:2052])
        assert torch.equal(f.read_at(1, t.nbytes - 6, torch.empty(3, dtype=torch.float16)), t[2, -3:])
