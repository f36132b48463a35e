"""Per-node producers: slot pool, group runner, hand-back, engine client, plugins."""

if __name__ != "strawq.producers":  # one identity per module: see docs/architecture.md
    raise ImportError(
        f"the folder producers/ is the package strawq.producers; import it by that name, not as "
        f"{__name__!r} (that would load a second, distinct copy of every module in it)"
    )
