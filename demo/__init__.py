"""The end-to-end run (``strawq demo``) and the rollout-schedule lab (``strawq lab``).

These modules wire every part together: Ray producers, local engines, the collector and a
trainer. They are drivers, not library code: ``strawq/`` never imports them.
"""
