"""A checkpoint's identity: what the weights at ``model.path`` are, in a few kilobytes read, not gigabytes.

Nodes that run one engine together must hold the same weights; the same ``model.path`` on two
machines may not be the same checkpoint (a different snapshot, a fine-tune, a half-finished
copy). The identity hashes ``config.json``, the index if there is one, and for every
``*.safetensors`` file its size, its header (every tensor's name, dtype, shape and place) and
:data:`SAMPLES` blocks of its data spread over the file, so two checkpoints of one architecture
with different weights differ even where their headers agree.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

SAMPLES = 16  # blocks of data read from each weight file
BLOCK = 4096  # bytes per block
MAX_HEADER = 100 << 20  # safetensors caps its header at 100 MB


def checkpoint_identity(directory: str | Path) -> str:
    """A hex digest of the checkpoint at ``directory``; a file that cannot be read counts as what it says."""
    root = Path(directory).expanduser()
    digest = hashlib.blake2b(digest_size=16)
    for name in ("config.json", "model.safetensors.index.json"):
        digest.update(name.encode() + b"\0" + _small_file(root / name))
    for path in sorted(root.glob("*.safetensors")):
        digest.update(path.name.encode() + b"\0" + _weights(path))
    return digest.hexdigest()


def _small_file(path: Path) -> bytes:
    try:
        with path.open("rb") as file:
            return file.read(MAX_HEADER)
    except OSError as error:
        return f"<{error.strerror}>".encode()


def _weights(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        return f"<{error.strerror}>".encode()
    try:
        size = os.fstat(fd).st_size
        head = os.pread(fd, 8, 0)
        header_len = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        header = os.pread(fd, min(header_len, MAX_HEADER), 8)
        start = 8 + header_len
        length = max(size - start, 0)
        blocks = [os.pread(fd, BLOCK, start + length * i // SAMPLES) for i in range(SAMPLES)] if length else []
        return struct.pack("<Q", size) + header + b"".join(blocks)
    except OSError as error:
        return f"<{error.strerror}>".encode()
    finally:
        os.close(fd)
