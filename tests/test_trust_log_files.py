"""A config's log file must be one plain file directly inside the run directory: the whole name is checked,
as composed and again once Hydra has resolved it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from hydra import compose
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, open_dict, read_write

from corelib.errors import ConfigError
from corelib.plugins import PluginRegistry
from corelib.startup.compose import hydra_context, prepare_config_store
from corelib.trust.hydra_config import check_hydra_node
from corelib.trust.logging_config import check_resolved_files


@pytest.fixture(scope="module")
def composed() -> DictConfig:
    prepare_config_store(PluginRegistry())
    with hydra_context():
        return compose(config_name="config", overrides=[], return_hydra_config=True)


def with_log_file(cfg: DictConfig, filename: str) -> DictConfig:
    changed = cfg.copy()
    with read_write(changed.hydra), open_dict(changed):
        changed.hydra.job_logging.handlers.file.filename = filename
    return changed


@pytest.mark.parametrize("filename", [
    "${hydra.runtime.output_dir}/run.log",
    "${hydra:runtime.output_dir}/${hydra.job.name}.log",
    "${hydra.runtime.output_dir}/serve-${hydra.job.name}.log",
])
def test_a_file_in_the_run_directory_is_accepted(composed: DictConfig, filename: str) -> None:
    check_hydra_node(with_log_file(composed, filename), [])


@pytest.mark.parametrize("filename", [
    "${hydra.runtime.output_dir}/logs/run.log",  # a subdirectory
    "${hydra.runtime.output_dir}/run.log/../../victim.txt",
    "${hydra.runtime.output_dir}/run.log extra",  # text after a valid name
    "${hydra.runtime.output_dir}/run.log\n",
    "victim.txt",
    "/tmp/${hydra.runtime.output_dir}/run.log",  # text before it
])
def test_anything_else_is_refused_naming_the_key(composed: DictConfig, filename: str) -> None:
    with pytest.raises(ConfigError, match=r"hydra\.job_logging\.handlers\.file\.filename: refused"):
        check_hydra_node(with_log_file(composed, filename), [])


@pytest.fixture
def running_job(composed: DictConfig, tmp_path: Path) -> Iterator[DictConfig]:
    """The config as Hydra holds it once a job has started in ``tmp_path/run``."""
    job = composed.copy()
    with open_dict(job):
        job.hydra.runtime.output_dir = str(tmp_path / "run")
    hydra_config = HydraConfig.instance()
    saved = hydra_config.cfg
    hydra_config.set_config(job)
    yield job
    hydra_config.cfg = saved


@pytest.mark.parametrize("filename", [
    "${hydra.runtime.output_dir}/../victim.log",
    "${hydra.runtime.output_dir}/logs/run.log",
    "/tmp/run.log",
])
def test_once_resolved_a_log_file_outside_the_run_directory_is_refused(running_job: DictConfig, filename: str) -> None:
    with pytest.raises(ConfigError, match=r"the log handler 'file': refused: .* resolves outside the run directory"):
        check_resolved_files(with_log_file(running_job, filename).hydra.job_logging)


def test_once_resolved_the_run_directory_log_is_accepted(running_job: DictConfig) -> None:
    check_resolved_files(running_job.hydra.job_logging)


def test_before_the_run_directory_is_known_no_log_file_is_opened(composed: DictConfig) -> None:
    with pytest.raises(ConfigError, match=r"the log handler 'file': refused: .* cannot be resolved yet"):
        check_resolved_files(composed.hydra.job_logging)
