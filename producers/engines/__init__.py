"""Local engines speaking SGLang 0.5.x's native HTTP protocol (``tiny``, ``sim``, ``router``).

Start one with ``python -m strawq.producers.engines serve --kind tiny --port 30000``; from
Python use :mod:`strawq.producers.engines.launch` or the helpers in
:mod:`strawq.producers.engines.testing`.
"""
