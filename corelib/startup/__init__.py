"""From the command line's overrides to a running plan: composing, checking and sizing, once per run.

- :mod:`~corelib.startup.compose`: the config tree composed with the plugins' options, checked, its
  errors in one line;
- :mod:`~corelib.startup.plugin_catalog`: the plugins' configs read by a child, for a torch-free process;
- :mod:`~corelib.startup.start`: the backend chosen and probed, the feature plan evaluated;
- :mod:`~corelib.startup.limits`: sizes and values that cannot work, refused before anything is built;
- :mod:`~corelib.startup.kv_pool`: how many KV blocks the pool gets.

Below the engine and the transports, which start from what this decides; above the models, ops
and the device, which it probes and measures.
"""
