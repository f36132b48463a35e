"""The queue commands of the CLI (init, release, status, inspect, gc) and their error messages."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from strawq.app.cli import main as cli_main
from strawq.delivery.batches import BatchStore
from strawq.ondisk.names import data_key
from strawq.storage import PosixStorage
from strawq.tasks.queue import RunQueue
from strawq.testing import make_group, write_jsonl
from strawq.testing.factories import prompts
from tests.strawq.queue_helpers import clobber, tid


def test_cli_init_release_status_inspect_gc(tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    run = str(tmp_path / "run")
    data = write_jsonl(tmp_path / "d.jsonl", [*prompts(5), "{broken"])
    assert cli_main(["init", run, "--set", "max_attempts=5", "--set", "release_batch=4"]) == 0
    out = capsys.readouterr().out
    assert "run ready" in out and '"max_attempts": 5' in out
    assert cli_main(["init", run, "--set", "max_attempts=5", "--set", "release_batch=4"]) == 0
    capsys.readouterr()
    assert cli_main(["init", run, "--set", "max_attempts=6"]) == 1
    assert "refusing to reopen" in capsys.readouterr().err

    assert cli_main(["release", run, data]) == 0
    assert "released 4 rows; cursor at index 4" in capsys.readouterr().out
    assert cli_main(["release", run, data, "--count", "10", "--max-bad-row-share", "1"]) == 0
    out = capsys.readouterr().out
    assert "released 1 of 2 rows (1 bad dropped" in out
    assert "cursor at index 6 (dataset exhausted)" in out

    q = RunQueue.open(PosixStorage(run))
    (lease,) = q.claim("prod-1")
    q.heartbeat("prod-1")
    q.complete(lease, make_group(lease.task_id, version=0))
    assert cli_main(["status", run, "--sample", "0"]) == 0
    out = capsys.readouterr().out
    assert "pending 4," in out and "ready 1," in out and "dropped 1" in out
    assert "bad_row 1" in out and "prod-1" in out
    assert cli_main(["status", run, "--json"]) == 0
    st = json.loads(capsys.readouterr().out)
    assert st["counts"] == {"pending": 4, "partial": 0, "leased": 0, "ready": 1,
                            "batched": 0, "dropped": 1}
    assert st["cursor"] == {"seq": 2, "next_index": 6, "exhausted": True}
    assert st["heartbeats"] == {"prod-1": 1}

    assert cli_main(["inspect", run, tid(0)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["kind"] == "TASK" and shown["name"]["holder_or_reason"] == "prod-1"
    assert cli_main(["inspect", run, data_key(tid(0), 0, "group"), "--tokens", "2"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["kind"] == "GROUP" and shown["samples"][0]["tokens"] == [1000, 1001]
    assert cli_main(["inspect", run, tid(5)]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["kind"] == "DROP" and "invalid JSON" in shown["meta"]["message"]
    assert cli_main(["inspect", run, "i404"]) == 1
    assert "i404" in capsys.readouterr().err
    clobber(PosixStorage(run), f"pending/r-000000000001/{q.find(tid(1))[1]}", b"torn")
    assert cli_main(["inspect", run, tid(1)]) == 1  # a record that fails its checks
    assert "truncated" in json.loads(capsys.readouterr().out)["error"]

    bs = BatchStore(q)
    bs.publish_batch(bs.next_seq(), bs.scan_ready())
    bs.ack(1)
    assert cli_main(["gc", run, "--full"]) == 0
    assert "gc: 1 batches, 1 group payloads" in capsys.readouterr().out


def test_cli_errors_are_messages_not_tracebacks(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["status", str(tmp_path / "nowhere")]) == 1
    assert "strawq init" in capsys.readouterr().err
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({"max_attempts": 3, "lease_timeout": 5}))
    assert cli_main(["init", str(tmp_path / "run"), "--config", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "unknown key(s) ['lease_timeout']" in err and "lease_timeout_s" in err
    assert not (tmp_path / "run").exists()
    assert cli_main([]) == 2
