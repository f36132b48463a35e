"""The run's queue configuration: unknown keys and wrong types refused, create idempotent,
open explained."""

from __future__ import annotations

import pytest

from strawq.config import QueueConfig, from_dict
from strawq.errors import ConfigError, NotFound
from strawq.ondisk import records
from strawq.ondisk.records import Kind
from strawq.storage import Storage
from strawq.tasks.queue import RunQueue
from tests.strawq.queue_helpers import make_queue


def test_config_unknown_keys_refused() -> None:
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['max_attempt'\]") as info:
        from_dict(QueueConfig, {"max_attempt": 3})
    assert "max_attempts" in str(info.value)  # the known keys are listed
    with pytest.raises(ConfigError):
        from_dict(QueueConfig, ["not", "a", "mapping"])  # type: ignore[arg-type]
    for bad in ({"max_attempts": 0}, {"lease_timeout_s": 0}, {"heartbeat_interval_s": 99},
                {"release_batch": 0}, {"group_size": 0}, {"prompt_key": ""}):
        with pytest.raises(ConfigError):
            from_dict(QueueConfig, bad)


def test_config_wrong_value_types_refused() -> None:
    for bad in ({"max_attempts": "3"}, {"fsync": "no"}, {"release_batch": 2.5}):
        with pytest.raises(ConfigError):
            from_dict(QueueConfig, bad)


def test_run_with_unknown_config_key_refused_on_open(storage: Storage) -> None:
    body = {"config": {"max_attempts": 3, "shiny_new_knob": 1}, "created_at": 0.0, "meta": {}}
    storage.publish("run.meta", records.encode(Kind.RUN, body))
    with pytest.raises(ConfigError, match="shiny_new_knob"):
        RunQueue.open(storage)


def test_create_is_idempotent_and_refuses_another_config(storage: Storage) -> None:
    q = make_queue(storage, max_attempts=4)
    assert RunQueue.create(storage, q.config).config == q.config
    with pytest.raises(ConfigError, match="refusing to reopen"):
        RunQueue.create(storage, QueueConfig(max_attempts=5))
    assert RunQueue.open(storage).config.max_attempts == 4


def test_open_without_a_run_says_what_to_do(storage: Storage) -> None:
    with pytest.raises(NotFound, match="strawq init"):
        RunQueue.open(storage)
