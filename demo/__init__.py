"""The end-to-end run (``strawq demo``) and the rollout-schedule lab (``strawq lab``).

These modules wire every part together: Ray producers, local engines, the collector and a
trainer. They are drivers, not library code: ``strawq/`` never imports them.
"""

if __name__ != "strawq.demo":  # one identity per module: see docs/architecture.md
    raise ImportError(
        f"the folder demo/ is the package strawq.demo; import it by that name, not as "
        f"{__name__!r} (that would load a second, distinct copy of every module in it)"
    )

