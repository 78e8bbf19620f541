"""Shared-memory segments: a full /dev/shm, a failed map, a sweep across PID namespaces, exit without close."""
# ``shm`` below is the segment module: SHM_DIR, where segments live, is read from it at each creation.

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from corelib.errors import TransportError
from corelib.transport import segment as shm
from corelib.transport.segment import PREFIX, Segment, sweep_stale
from corelib.transport.shm import Ring

NOT_A_PID = 2**22 + 4242  # above the default pid_max: the sweeper cannot see such a process


def ours(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.name.startswith(f"{PREFIX}-{os.getpid()}-")}


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], capture_output=True, text=True,
                          timeout=120, check=False)


@pytest.fixture
def tiny_shm(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs mounted over a directory: a /dev/shm that is nearly full."""
    where = tmp_path / "shm"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=1777", "tmpfs", str(where)],
                             capture_output=True, text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.slow
def test_a_full_shm_is_a_one_line_error_not_sigbus(tiny_shm: Path) -> None:
    # In a child: without the reservation the first touch of a page tmpfs cannot supply is SIGBUS.
    child = run_python("""
        import sys
        from pathlib import Path
        from corelib.transport import segment
        from corelib.transport.shm import Ring
        from corelib.errors import TransportError
        segment.SHM_DIR = Path(sys.argv[1])
        try:
            ring = Ring.create("in", 4, 1 << 20)
            ring.whole.fill_(7)
        except TransportError as error:
            print(error)
            sys.exit(3)
    """, str(tiny_shm))
    assert child.returncode == 3, f"exit {child.returncode} (-7 is SIGBUS): {child.stderr[-2000:]}"
    message = child.stdout.strip()
    assert "\n" not in message
    assert "needs 4.0 MiB" in message and "has 0.2 MiB free" in message and str(tiny_shm) in message, message
    assert "engine.shm.num_slots" in message, "the error should say what to lower"
    assert not list(tiny_shm.iterdir()), "the segment that could not be reserved was left behind"


def test_no_space_at_reservation_is_named_and_nothing_is_left(monkeypatch: pytest.MonkeyPatch) -> None:
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    before = ours(shm.SHM_DIR)
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(TransportError, match=r"needs 8\.0 MiB \(8388608 bytes\) but /dev/shm has [\d.]+ MiB free"):
        Segment(shm.segment_name("in"), 8 << 20, create=True)
    assert ours(shm.SHM_DIR) == before


def test_a_segment_whose_map_fails_is_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_map(*args: object, **kwargs: object) -> mmap.mmap:
        raise OSError(errno.ENOMEM, os.strerror(errno.ENOMEM))

    before = ours(shm.SHM_DIR)
    monkeypatch.setattr(mmap, "mmap", no_map)
    with pytest.raises(TransportError, match=r"cannot map 0\.1 MiB: Cannot allocate memory"):
        Ring.create("in", 2, 64 << 10)
    assert ours(shm.SHM_DIR) == before, "a segment created before the failed map was left behind"


def test_the_sweep_keeps_segments_leased_from_another_pid_namespace(private_shm: Path) -> None:
    # A live engine elsewhere: its pid means nothing here, but it holds the segment's lease.
    leased = private_shm / f"{PREFIX}-{NOT_A_PID}-0a0b0c0d-in"
    orphan = private_shm / f"{PREFIX}-{NOT_A_PID}-0e0f0a0b-out"
    for path in (leased, orphan):
        path.write_bytes(bytes(4096))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDONLY); "
         "fcntl.flock(fd, fcntl.LOCK_SH); print('held', flush=True); sys.stdin.read()", str(leased)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        removed = sweep_stale()
        assert orphan.name in removed and not orphan.exists(), "a segment nobody holds should be removed"
        assert leased.name not in removed and leased.exists(), "a leased segment was deleted under its owner"
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(10)
    assert leased.name in sweep_stale(), "once its owner is gone the segment is stale"


def test_a_segment_holds_its_lease_while_mapped() -> None:
    segment = Segment(shm.segment_name("in"), 4096, create=True)
    try:
        fd = os.open(segment.path, os.O_RDONLY)
        try:
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        segment.close()
    assert not segment.path.exists()


@pytest.mark.slow
def test_exiting_without_close_removes_the_segments() -> None:
    child = run_python("""
        from corelib.transport.shm import Ring
        rings = [Ring.create("in", 2, 4096, num_consumers=2), Ring.create("out", 2, 4096)]
        print(" ".join(ring.segment.name for ring in rings))
    """)
    assert child.returncode == 0, child.stderr[-2000:]
    names = child.stdout.split()
    assert len(names) == 2 and all(name.startswith(PREFIX) for name in names)
    left = [name for name in names if (shm.SHM_DIR / name).exists()]
    for name in left:
        (shm.SHM_DIR / name).unlink()
    assert not left, f"a normal exit left {left} in {shm.SHM_DIR}"


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_the_sweep_never_blocks_on_or_removes_what_is_not_a_segment(kind: str, tmp_path: Path,
                                                                    private_shm: Path) -> None:
    # Anyone may plant a FIFO under a segment's name in /dev/shm; opening it to read would wait for a
    # writer that never comes, and every engine start on the host sweeps first.
    planted = private_shm / f"{PREFIX}-{NOT_A_PID}-0badf1f0-{kind}"
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    if kind == "fifo":
        os.mkfifo(planted)
    elif kind == "symlink":
        planted.symlink_to(victim)
    else:
        planted.mkdir()
    swept: list[list[str]] = []
    sweeper = threading.Thread(target=lambda: swept.append(sweep_stale()), daemon=True)
    try:
        sweeper.start()
        sweeper.join(60)  # returns at once; the bound only keeps a regression from hanging the suite
        blocked = sweeper.is_alive()
        if blocked and kind == "fifo":
            os.close(os.open(planted, os.O_WRONLY | os.O_NONBLOCK))  # let the blocked open go
        assert not blocked and swept, "the sweep blocked on the planted name"
        assert planted.name not in swept[0] and os.path.lexists(planted), "the sweep removed what it did not make"
        assert victim.read_bytes() == b"keep"
    finally:
        sweeper.join(60)
        if planted.is_dir() and not planted.is_symlink():
            planted.rmdir()
        else:
            planted.unlink()


def test_a_segment_name_taken_by_a_fifo_is_refused_without_blocking() -> None:
    name = shm.segment_name("in")
    os.mkfifo(shm.SHM_DIR / name)
    try:
        with pytest.raises(TransportError, match="is not a file of this user's"):
            Segment(name, 4096, create=False)
    finally:
        (shm.SHM_DIR / name).unlink()
