"""The composition root: the ``strawq`` command line and the run config.

These modules wire the core (``strawq``), the producers, the collector and the demo
together, so they are the only part of the ``strawq`` package that may import all of them;
the core never imports this package (``tests/test_layering.py`` checks it).
"""
