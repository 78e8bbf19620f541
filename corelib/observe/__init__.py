"""What the engine reports about itself: run metrics (:mod:`~corelib.observe.metrics`) and the
step timeline (:mod:`~corelib.observe.trace`)."""
