"""The commands: ``python -m corelib ...`` and the ``corelib`` console script.

- :mod:`~corelib.cli.main`: the entry point, its commands and their help;
- :mod:`~corelib.cli.hydra_app` and :mod:`~corelib.cli.config_help`: a command as a Hydra app, and
  ``COMMAND --help``;
- :mod:`~corelib.cli.habits`: the command-line habits a vLLM user brings (shared with ``corelib.LLM``);
- :mod:`~corelib.cli.commands`: the bodies of the commands;
- :mod:`~corelib.cli.run`, :mod:`~corelib.cli.bench` (with :mod:`~corelib.cli.bench_prompts` and
  :mod:`~corelib.cli.bench_serving`) and :mod:`~corelib.cli.trace_plot`: ``run``, ``bench`` and ``trace-plot``.

The top of the house: a command may use every layer, and no layer imports a command.
"""
