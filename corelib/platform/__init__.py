"""The device layer: what an accelerator offers the engine, and how a backend plugin provides one.

- :mod:`~corelib.platform.device`: the ``Device`` interface (streams, events, memory, host
  registration) and a device's declared capabilities;
- :mod:`~corelib.platform.graph`: captured device graphs and their parameters;
- :mod:`~corelib.platform.memory`: the bookkeeping of what a device handed out or pinned;
- :mod:`~corelib.platform.backend`: the ``Backend`` a plugin subclasses: its probe, native or emulated;
- :mod:`~corelib.platform.native`: devices driven through a torch device module (CUDA, NPU, MLU);
- :mod:`~corelib.platform.emulator`: the stream emulator that stands in for an absent accelerator.

Backend plugins import the public modules by their names at the root (``corelib.device``,
``corelib.graph``, ``corelib.backend``, ``corelib.native``), which re-export these.
"""
