"""What every run writes into its output directory, and the formats of those files.

- ``config.yaml``: the resolved config (backend=auto already replaced by the chosen one);
- ``plan.json``: the startup lines, the backend, runtime and capabilities, and each feature's
  decision and reasons (the same as ``python -m corelib plan`` prints);
- ``metrics.json``: run-level figures (see :class:`corelib.observe.metrics.RunMetrics`);
- ``outputs.jsonl``: one :class:`RequestRecord` per line, written as each request finishes.

Every file is written so that a failure leaves nothing half-written: ``outputs.jsonl`` gets each
line with one write of the whole line, flushed to the file at once (a run stopped by Ctrl-C
keeps every request that finished), and a line the disk could only take in part is cut back
off; the other files are written beside their name and renamed into place. None is written
through a symlink or into a FIFO someone planted in an existing directory. A failed write is a
:class:`RunDirError` naming the file and the errno.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from corelib.config.features import Plan
from corelib.trust.files import open_for_append, write_failed, write_whole

if TYPE_CHECKING:
    from corelib.startup.start import Startup


SECRET_KEYS = ("server.api_key", "server.bench.api_key")
REDACTED = "<set>"


def redacted(config: DictConfig) -> DictConfig:
    """A copy of ``config`` whose secrets (``SECRET_KEYS``) that are set read ``<set>``."""
    shown = config.copy()
    for key in SECRET_KEYS:
        if OmegaConf.select(shown, key, default=None, throw_on_resolution_failure=False) is not None:
            OmegaConf.update(shown, key, REDACTED, force_add=True)
    return shown


@dataclass(frozen=True)
class RequestRecord:
    """One line of ``outputs.jsonl``."""

    id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str  # stop (EOS or a stop id), length (max_tokens), error, or cancelled
    text: str | None = None  # decoded output, when the model has a tokenizer
    error: str | None = None  # why the request failed, when finish_reason is error
    ttft_ms: float | None = None  # time to first token: from the request's arrival to its first output token
    tpot_ms: float | None = None  # time per output token after the first (None with fewer than two)

    def as_dict(self) -> dict[str, Any]:
        record = asdict(self)
        if record["text"] is None:
            del record["text"]
        if record["error"] is None:
            del record["error"]
        return record  # ttft_ms and tpot_ms stay, null where not defined: every line has the same columns


class RunDir:
    """Writes a run's files. Created by the entry point, passed down."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)

    def write_config(self, config: DictConfig) -> Path:
        """The resolved config, with the API keys shown as ``<set>`` (the run directory is not a secret)."""
        return self._write("config.yaml", OmegaConf.to_yaml(redacted(config), resolve=True))

    def write_plan(
        self, plan: Plan, messages: Iterable[str] = (), details: Mapping[str, Any] | None = None
    ) -> Path:
        """``{"startup": [lines], **details, "features": {name: decision}}``."""
        payload: dict[str, Any] = {"startup": list(messages), **(details or {}), "features": plan.as_dict()}
        return self._write("plan.json", json.dumps(payload, indent=2) + "\n")

    def record_startup(self, startup: Startup) -> None:
        """``config.yaml`` and ``plan.json`` of a run that has started: every run has them."""
        self.write_config(startup.raw)
        spec = startup.spec
        self.write_plan(startup.plan, startup.messages, details={
            "backend": spec.backend, "runtime": spec.runtime.value, "capabilities": spec.capabilities.as_dict()})

    def write_metrics(self, metrics: Mapping[str, Any]) -> Path:
        return self._write("metrics.json", json.dumps(metrics, indent=2, sort_keys=True) + "\n")

    def outputs(self) -> OutputsWriter:
        """``outputs.jsonl``, opened for one line per request as each finishes."""
        return OutputsWriter(self.path / "outputs.jsonl")

    def file(self, name: str) -> Path:
        return self.path / name

    def write_file(self, name: str, text: str) -> Path:
        """Another file of the run (``bench.json``), written whole (see :func:`corelib.trust.files.write_whole`)."""
        return write_whole(self.path / name, text)

    def _write(self, name: str, text: str) -> Path:
        return write_whole(self.path / name, text)


class OutputsWriter:
    """Appends whole JSON lines to ``outputs.jsonl``, each on disk before ``write`` returns."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lines = 0
        self._fd: int | None = open_for_append(path)  # never through a symlink or into a FIFO planted there
        self._size = 0

    def write(self, record: RequestRecord) -> None:
        if self._fd is None:
            raise RuntimeError(f"{self.path} is closed")
        line = (json.dumps(record.as_dict()) + "\n").encode()
        try:
            # One write of the whole line, unbuffered: no Python buffer holds finished requests
            # back, and a reader never sees two half lines interleaved.
            written = os.write(self._fd, line)
            while written < len(line):  # a disk that took only part of it: the next write says why
                written += os.write(self._fd, line[written:])
        except OSError as error:
            self._cut_back()
            raise write_failed(self.path, error, f"; it keeps the {self.lines} complete line(s) written before"
                                ) from None
        self._size += len(line)
        self.lines += 1

    def _cut_back(self) -> None:
        """Remove a partly written line, so the file ends with the last complete one."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):  # the file then ends in a cut line; the error names the file
            os.ftruncate(self._fd, self._size)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OutputsWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def read_outputs(path: Path) -> list[dict[str, Any]]:
    """Read an ``outputs.jsonl`` back (for tests and comparisons)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
