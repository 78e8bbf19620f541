"""What corelib takes from places it does not control, and what it hands a process it starts.

- :mod:`~corelib.trust.hydra_config`, :mod:`~corelib.trust.logging_config` and
  :mod:`~corelib.trust.task_config`: what a config file (possibly from a shared directory) may ask
  of Hydra, of logging and of the task config;
- :mod:`~corelib.trust.files`: files read from elsewhere (only regular files, bounded) and files
  written where someone else may have been first;
- :mod:`~corelib.trust.hub`: a checkpoint from the Hugging Face hub cache, or downloaded;
- :mod:`~corelib.trust.isolation`: the isolated interpreter and the environment of a worker process.

Torch-free, and importing nothing of corelib but its errors: every layer may use it.
"""
