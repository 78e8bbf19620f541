"""What every layer uses beside its own work: progress on the console, fault injection, text and output structure.

- :mod:`~corelib.support.progress`: what a command shows while it works (a rich bar, or log lines);
- :mod:`~corelib.support.faults`: the named fault points tests and ``CORELIB_FAULTS`` trigger;
- :mod:`~corelib.support.text`: text in and out through a checkpoint's tokenizer;
- :mod:`~corelib.support.structured`: the structure a request's output must take (torch-free);
- :mod:`~corelib.support.stats`: the percentile every report uses.

Low in the house: the models and the device step report progress and reach fault points, so these
import nothing above the trust layer.
"""
