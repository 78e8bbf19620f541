"""A config's log file must be one plain file directly inside the run directory: the whole name is checked."""

from __future__ import annotations

import pytest
from hydra import compose
from omegaconf import DictConfig, open_dict

from corelib.compose import hydra_context, prepare_config_store
from corelib.errors import ConfigError
from corelib.plugins import PluginRegistry
from corelib.trust import check_hydra_node


@pytest.fixture(scope="module")
def composed() -> DictConfig:
    prepare_config_store(PluginRegistry())
    with hydra_context():
        return compose(config_name="config", overrides=[], return_hydra_config=True)


def with_log_file(cfg: DictConfig, filename: str) -> DictConfig:
    changed = cfg.copy()
    with open_dict(changed):
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
