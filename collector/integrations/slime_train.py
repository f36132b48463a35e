"""slime's own trainer-side code run on the samples strawq hands it.

``RolloutManager`` is a stand-in for slime's ray actor of that name that carries slime's
*real* ``_post_process_rewards`` and ``_convert_samples_to_train_data``: their text is read
from the pinned slime source (``slime/ray/rollout.py``) and compiled here, because that
module imports SGLang at its top while these two methods use only torch, ``Sample`` and
slime helpers that import without it. What slime would train from a batch strawq returns
(``generate_rollout``) is computed by slime's code, not by a copy of it.
"""

from __future__ import annotations

import ast
import importlib.util
import itertools
from collections.abc import Sequence
from typing import Any

from strawq.collector.integrations.slime_samples import _slime

#: the methods of slime's ``RolloutManager`` this stand-in carries
MANAGER_METHODS = ("_post_process_rewards", "_convert_samples_to_train_data")
_compiled: dict[str, Any] = {}


def _manager_methods() -> dict[str, Any]:
    """slime's ``RolloutManager`` methods (``MANAGER_METHODS``), compiled from its source."""
    if _compiled:
        return _compiled
    _slime("slime.utils.types")  # says how to install slime when it is missing
    spec = importlib.util.find_spec("slime.ray.rollout")
    if spec is None or spec.origin is None:
        raise ImportError("slime.ray.rollout is not in the installed slime source")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=spec.origin)
    cls = next((n for n in tree.body if isinstance(n, ast.ClassDef)
                and n.name == "RolloutManager"), None)
    if cls is None:
        raise ImportError(f"{spec.origin} defines no RolloutManager")
    found = {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef)
             and n.name in MANAGER_METHODS}
    missing = [m for m in MANAGER_METHODS if m not in found]
    if missing:
        raise ImportError(f"slime's RolloutManager ({spec.origin}) has no {missing}")
    data_utils = _slime("slime.observability.rollout_data_utils")
    namespace: dict[str, Any] = {
        "torch": _slime("torch"), "itertools": itertools,
        "Sample": _slime("slime.utils.types").Sample,
        "get_source": _slime("slime.utils.data").get_source,
        "validate_rollout_routed_experts_for_replay":
            data_utils.validate_rollout_routed_experts_for_replay,
        "__name__": "slime.ray.rollout"}
    module = ast.Module(body=[found[m] for m in MANAGER_METHODS], type_ignores=[])
    exec(compile(module, spec.origin, "exec"), namespace)  # noqa: S102 - slime's own source
    _compiled.update({m: namespace[m] for m in MANAGER_METHODS})
    return _compiled


class RolloutManager:
    """The part of slime's ``RolloutManager`` that turns rollout samples into train data.

    ``args`` is slime's namespace; ``custom_reward_post_process_path`` and
    ``custom_convert_samples_to_train_data_path`` are loaded with slime's own
    ``load_function``, as its ``__init__`` does.
    """

    def __init__(self, args: Any) -> None:
        load_function = _slime("slime.utils.misc").load_function
        self.args = args
        path = getattr(args, "custom_reward_post_process_path", None)
        self.custom_reward_post_process_func = load_function(path) if path else None
        path = getattr(args, "custom_convert_samples_to_train_data_path", None)
        self.custom_convert_samples_to_train_data_func = load_function(path) if path else None
        methods = _manager_methods()
        self._post = methods["_post_process_rewards"]
        self._convert = methods["_convert_samples_to_train_data"]

    def _post_process_rewards(self, samples: Sequence[Any]) -> Any:
        return self._post(self, samples)

    def _convert_samples_to_train_data(self, samples: Sequence[Any]) -> Any:
        return self._convert(self, samples)


def flatten(groups: Sequence[Any]) -> list[Any]:
    """A rollout function's nested groups as the flat sample list slime trains on (what
    ``RolloutManager._get_rollout_data`` does after ``validate_rollout_id_annotated``)."""
    data = list(groups)
    while data and isinstance(data[0], list):
        data = list(itertools.chain.from_iterable(data))
    return data


__all__ = ["MANAGER_METHODS", "RolloutManager", "flatten"]
