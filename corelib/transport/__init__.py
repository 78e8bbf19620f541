"""Where steps run: the executor of this process's device, or SHM worker processes (and other nodes).

- :mod:`~corelib.transport.executor`: the executor interface and the in-process executor;
- :mod:`~corelib.transport.shm_executor` and :mod:`~corelib.transport.worker`: the two ends of
  ``engine.transport=shm``;
- :mod:`~corelib.transport.shm`, :mod:`~corelib.transport.doorbell`, :mod:`~corelib.transport.segment`:
  the rings, their doorbells and their shared-memory segments;
- :mod:`~corelib.transport.wire`: frames and results as both ends read them;
- :mod:`~corelib.transport.nodes` and :mod:`~corelib.transport.parallel`: several nodes, and the
  tensor-parallel process groups and all-reduces.
"""
