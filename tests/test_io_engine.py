"""The direct-I/O engine from Python (zero_py.io): round trips against the bytes written,
several requests in flight, the sequential writer's padding and truncation, and the errors a
user meets (a missing directory, a short read, a misaligned direct request, a full disk)."""

import os
import subprocess
import sys

import pytest
import torch

from zero_py.io import IO_ALIGN, DirectFile, IoEngine, SequentialWriter, aligned_empty


def _random_bytes(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed),
                         dtype=torch.uint8)


def test_aligned_buffers():
    for n in (1, IO_ALIGN, 3 * IO_ALIGN + 5):
        buf = aligned_empty(n)
        assert buf.data_ptr() % IO_ALIGN == 0 and buf.numel() >= n
        assert buf.numel() % IO_ALIGN == 0


@pytest.mark.parametrize("direct", [True, False])
def test_round_trip_with_requests_in_flight(tmp_path, direct):
    engine = IoEngine(n_threads=3, max_inflight=8)
    chunk, n = 64 * 1024, 24
    data = _random_bytes(chunk * n, 1)
    src = aligned_empty(chunk * n)
    src.copy_(data)
    with DirectFile(tmp_path / "f", writable=True, direct=direct) as f:
        tickets = []
        for k in range(n):
            if len(tickets) == 8:
                engine.wait(tickets.pop(0))
            tickets.append(engine.write(f, src[k * chunk:(k + 1) * chunk], k * chunk))
        for t in tickets:
            engine.wait(t)
        f.fsync()
    assert os.path.getsize(tmp_path / "f") == chunk * n
    dst = aligned_empty(chunk * n)
    with DirectFile(tmp_path / "f", direct=direct) as f:
        tickets = [engine.read(f, dst[k * chunk:(k + 1) * chunk], k * chunk)
                   for k in reversed(range(8))]
        for t in tickets:
            engine.wait(t)
        for k in range(8, n):
            engine.wait(engine.read(f, dst[k * chunk:(k + 1) * chunk], k * chunk))
    assert torch.equal(dst[:chunk * n], data)
    engine.close()


@pytest.mark.parametrize("size", [0, 1, IO_ALIGN - 1, 5 * 4096 + 17, 3 << 20])
def test_sequential_writer_writes_exactly_the_bytes(tmp_path, size):
    data = _random_bytes(size, 2)
    w = SequentialWriter(tmp_path / "s", buffer_bytes=1 << 20, n_buffers=2)
    view = memoryview(data.numpy())
    for lo in range(0, size, 300_001):  # pieces that straddle the staging buffers
        w.write(view[lo:lo + 300_001])
    assert w.close() == size
    with open(tmp_path / "s", "rb") as f:
        assert f.read() == bytes(data.numpy())


def test_errors_say_what_is_wrong(tmp_path):
    engine = IoEngine(n_threads=2, max_inflight=2)
    with pytest.raises(ValueError, match="cannot open .*missing_dir.* No such file"):
        DirectFile(tmp_path / "missing_dir" / "f", writable=True)
    buf = aligned_empty(4 * IO_ALIGN)
    with DirectFile(tmp_path / "f", writable=True) as f:
        engine.wait(engine.write(f, buf[:2 * IO_ALIGN], 0))
        if f.direct:
            with pytest.raises(ValueError, match="multiples of 4096"):
                engine.write(f, buf[1:IO_ALIGN + 1], 0)
        t = engine.read(f, buf, 0)  # 16 KiB from an 8 KiB file
        with pytest.raises(IndexError, match="short read"):
            engine.wait(t)
        with pytest.raises(ValueError, match="not a request in flight"):
            engine.wait(t)  # spent
    with pytest.raises(ValueError, match="n_threads"):
        IoEngine(n_threads=0)


def test_a_full_disk_is_an_os_error_naming_the_file(tmp_path):
    """The file-size limit refuses writes as a full disk does (EFBIG / ENOSPC)."""
    code = f"""
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, resource.RLIM_INFINITY))
from zero_py.io import SequentialWriter
w = SequentialWriter({str(tmp_path / "big")!r}, buffer_bytes=1 << 20, n_buffers=2)
try:
    w.write(memoryview(bytes(4 << 20)))
    w.close()
except OSError as exc:
    print("OSError:", exc)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60)
    assert "OSError:" in out.stdout and "big" in out.stdout, out.stdout + out.stderr
