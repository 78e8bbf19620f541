"""What every run writes into its output directory, and the formats of those files.

- ``config.yaml``: the resolved config (backend=auto already replaced by the chosen one);
- ``plan.json``: the startup lines, the backend, runtime and capabilities, and each feature's
  decision and reasons (the same as ``python -m corelib plan`` prints);
- ``metrics.json``: run-level figures (see :class:`corelib.engine.metrics.RunMetrics`);
- ``outputs.jsonl``: one :class:`RequestRecord` per line, in request order.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from corelib.features import Plan


@dataclass(frozen=True)
class RequestRecord:
    """One line of ``outputs.jsonl``."""

    id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    finish_reason: str  # stop (EOS or a stop id), length (max_tokens), error, or cancelled
    text: str | None = None  # decoded output, when the model has a tokenizer
    error: str | None = None  # why the request failed, when finish_reason is error

    def as_dict(self) -> dict[str, Any]:
        record = asdict(self)
        if record["text"] is None:
            del record["text"]
        if record["error"] is None:
            del record["error"]
        return record


class RunDir:
    """Writes a run's files. Created by the entry point, passed down."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)

    def write_config(self, config: DictConfig) -> Path:
        target = self.path / "config.yaml"
        target.write_text(OmegaConf.to_yaml(config, resolve=True))
        return target

    def write_plan(
        self, plan: Plan, messages: Iterable[str] = (), details: Mapping[str, Any] | None = None
    ) -> Path:
        """``{"startup": [lines], **details, "features": {name: decision}}``."""
        target = self.path / "plan.json"
        payload: dict[str, Any] = {"startup": list(messages), **(details or {}), "features": plan.as_dict()}
        target.write_text(json.dumps(payload, indent=2) + "\n")
        return target

    def write_metrics(self, metrics: Mapping[str, Any]) -> Path:
        target = self.path / "metrics.json"
        target.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        return target

    def write_outputs(self, records: Iterable[RequestRecord]) -> Path:
        target = self.path / "outputs.jsonl"
        with target.open("w") as handle:
            for record in records:
                handle.write(json.dumps(record.as_dict()) + "\n")
        return target

    def file(self, name: str) -> Path:
        return self.path / name


def read_outputs(path: Path) -> list[dict[str, Any]]:
    """Read an ``outputs.jsonl`` back (for tests and comparisons)."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
