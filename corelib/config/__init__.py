"""What a run is asked for and what it decides: the config schema, the feature gates and the plan.

- :mod:`~corelib.config.schema`: the typed schema of the composed Hydra config, each key's meaning;
- :mod:`~corelib.config.gate_catalog`: the feature gates a config composes (corelib's and the plugins');
- :mod:`~corelib.config.features`: the gates evaluated into a ``Plan``;
- :mod:`~corelib.config.options`: the plan as typed ``EngineOptions``, the one place a gate is read by name.

Data only: every layer reads these, so they import nothing of corelib but its errors.
"""
