"""The slime flags each mode sets (``docs/slime.md``), one list for the launcher
(``deploy/examples/slime_job.py``), the docs test and the loop harness
(``strawq.testing.slime_loop``): the dotted paths are resolved by slime's own
``load_function``."""

from __future__ import annotations

from typing import Any

ADAPTER = "strawq.collector.integrations.slime"

#: slime flags per mode: ``data-source`` (slime generates, strawq keeps the data) and
#: ``collector`` (strawq's producers generate, slime trains)
MODES: dict[str, list[str]] = {
    "data-source": [
        "--data-source-path", f"{ADAPTER}.StrawqDataSource",
        "--rollout-function-path", f"{ADAPTER}.slime_rollout",
        # aborted groups come back through add_samples and are kept as partial tasks
        "--partial-rollout",
    ],
    "collector": [
        "--data-source-path", f"{ADAPTER}.StrawqBatchSource",
        "--rollout-function-path", f"{ADAPTER}.generate_rollout",
        "--eval-function-path", "slime.rollout.sglang_rollout.generate_rollout",
        "--custom-update-weight-post-write-path", f"{ADAPTER}.begin_weight_update_hook",
        # slime trains the manifest's advantages (computed within each group), not its own
        # normalisation of the rewards across the batch
        "--custom-reward-post-process-path", f"{ADAPTER}.reward_post_process",
        "--advantage-estimator", "grpo",
        # strawq's documented objective: token-level TIS min(rho, 2) (docs/slime.md)
        "--use-tis", "--tis-clip", "2", "--tis-clip-low", "0",
    ],
}


def flags_to_args(flags: list[str]) -> dict[str, Any]:
    """slime's ``args`` attributes a flag list sets (``--a-b x`` → ``a_b="x"``, a flag
    without a value → True), numbers parsed."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(flags):
        key = flags[i]
        if not key.startswith("--"):
            raise ValueError(f"expected a flag at {key!r}")
        name = key[2:].replace("-", "_")
        if i + 1 < len(flags) and not flags[i + 1].startswith("--"):
            val: Any = flags[i + 1]
            for cast in (int, float):
                try:
                    val = cast(val)
                    break
                except ValueError:
                    continue
            out[name] = val
            i += 2
        else:
            out[name] = True
            i += 1
    return out


__all__ = ["ADAPTER", "MODES", "flags_to_args"]
