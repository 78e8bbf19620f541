"""The device step: a packed step's inputs staged onto the device, the forward (eager or a replayed
graph), and its sampled tokens handed back; the same in process and in an SHM worker.

- :mod:`~corelib.step.fields`, :mod:`~corelib.step.arena` and :mod:`~corelib.step.forward_input`: what a
  step is, in bytes: the step layout, the arenas and their pool, one step's shape;
- :mod:`~corelib.step.layout` and :mod:`~corelib.step.buckets`: sizes and graph shapes from the config;
- :mod:`~corelib.step.staging`: how the inputs reach the device (inline, host, ordered, early);
- :mod:`~corelib.step.runner`: the forward and the captured graphs;
- :mod:`~corelib.step.handoff`: the token relay and the pinned buffers the host reads;
- :mod:`~corelib.step.device_steps` and :mod:`~corelib.step.pipeline`: one step end to end, and how
  many may be in flight;
- :mod:`~corelib.step.build`: all of it built on a device.
"""
