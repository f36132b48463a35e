"""One owner per key family: each family's names are built and parsed in one core module,
and every "over η?" question is ``EtaPolicy.over``. The grep-style tests read the source:
a second spelling of a key (a raw ``f"dropped/{name}"`` delete, a hand-parsed ``bseq-``
listing) fails them."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import numpy as np
import pytest

from strawq.delivery.batches import (
    BatchStore,
    ack_key,
    batch_seqs,
    delivered,
    high_water,
    manifest_key,
    mark_delivered,
    mark_high_water,
)
from strawq.delivery.retention import compact_drops, drop_totals
from strawq.ondisk.names import TaskName
from strawq.storage import MemoryStorage
from strawq.tasks.epochs import (
    closed_key,
    epoch_key,
    epoch_starts,
    epochs,
    heartbeat_counter,
    heartbeat_key,
    list_names,
    mark_epoch_start,
    prunable,
)
from strawq.tasks.eta import MODES, EtaPolicy
from strawq.tasks.queue import RunQueue
from strawq.tasks.states import (
    RETIRED,
    IllegalTransition,
    TaskState,
    check_transition,
    key_of,
    move,
    retire,
)

ROOT = Path(__file__).resolve().parents[1]
#: the source trees (the linked packages are read at their top-level folders, once)
TREES = ("strawq", "collector", "producers", "demo")
LINKS = {"strawq/collector", "strawq/producers", "strawq/demo"}

#: key prefix -> the one module that may spell it at the start of a string
OWNERS = {
    "bseq-": "strawq/delivery/batches.py",
    "batches/": "strawq/delivery/batches.py",
    "acked/": "strawq/delivery/batches.py",
    "delivered/": "strawq/delivery/batches.py",
    "epoch-": "strawq/tasks/epochs.py",
    "closed-": "strawq/tasks/epochs.py",
    "start-": "strawq/tasks/epochs.py",
    "hb-": "strawq/tasks/epochs.py",
    "holder-": "strawq/tasks/trainer_epochs.py",
    "beat-": "strawq/tasks/trainer_epochs.py",
    "released-": "strawq/tasks/trainer_epochs.py",
    "incarnations/": "strawq/tasks/incarnations.py",
    "policy-": "strawq/tasks/eta.py",
    "audit/": "strawq/delivery/retention.py",
    "drops-": "strawq/delivery/retention.py",
    "history/": "strawq/data/history.py",
    "cursor/": "strawq/data/cursor.py",
    "packed/": "strawq/delivery/packed.py",
    "journal/": "strawq/tasks/journal.py",
    "format/": "strawq/tasks/formats.py",
    "fingerprints/": "strawq/weights/fingerprint.py",
    "attested/": "strawq/weights/fingerprint.py",
    "manifest-": "strawq/weights/publish.py",  # weights/manifest-<v>: a published version
    "wave-": "strawq/weights/publish.py",  # weights/wave-<v>~<k>: a wave slot
    "dropped/": "collector/trainer/metrics.py",  # the metric name; the entries go through states.py
    # the adapters' stores (``strawq.tasks.states.STORES``): verl's queue directory
    "samples/": "strawq/tasks/states.py",
    "incoming/": "strawq/tasks/states.py",
    "commits/": "strawq/tasks/states.py",
    "drops/": "strawq/tasks/states.py",
    "partials/": "strawq/tasks/states.py",
    "held/": "strawq/tasks/states.py",
}
#: the adapters whose records live in a store declared in ``strawq.tasks.states``
STORE_USERS = ("collector/integrations/verl",)


def _sources() -> list[Path]:
    out = []
    for tree in TREES:
        for p in sorted((ROOT / tree).rglob("*.py")):
            rel = p.relative_to(ROOT).as_posix()
            if any(rel.startswith(link + "/") for link in LINKS):
                continue
            out.append(p)
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


@functools.lru_cache(maxsize=None)
def _string_heads(path: Path) -> list[tuple[int, str]]:
    """(line, text) of every string literal and f-string head in ``path``, docstrings left out
    (read once per file: each family's test scans every source)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    inner = {id(v) for node in ast.walk(tree) if isinstance(node, ast.JoinedStr)
             for v in node.values}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr) and node.values and \
                isinstance(node.values[0], ast.Constant) and isinstance(node.values[0].value, str):
            out.append((node.lineno, node.values[0].value))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                id(node) not in skip and id(node) not in inner:
            out.append((node.lineno, node.value))
    return out


def test_the_scan_sees_the_owners_spellings():
    """The scan itself can fail: it finds each family in its owner."""
    found = {prefix: False for prefix in OWNERS}
    for prefix, owner in OWNERS.items():
        for _line, text in _string_heads(ROOT / owner):
            if text.startswith(prefix) or text == prefix.rstrip("/"):
                found[prefix] = True
    assert all(found.values()), [p for p, ok in found.items() if not ok]


@pytest.mark.slow
@pytest.mark.parametrize("prefix", sorted(OWNERS))
def test_each_key_family_is_spelled_by_its_owner_only(prefix: str):
    owner = OWNERS[prefix]
    strays = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel == owner:
            continue
        for line, text in _string_heads(path):
            if text.startswith(prefix):
                strays.append(f"{rel}:{line}: {text!r}")
    assert not strays, f"{prefix!r} is spelled outside {owner}: {strays}"


def test_the_dropped_directory_is_named_in_the_state_table_only():
    """``dropped/`` entries are moved and retired through ``strawq.tasks.states`` (``key_of``,
    ``move``, ``retire``): no module builds their keys from the directory name."""
    strays = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel in ("strawq/tasks/states.py", "collector/trainer/metrics.py"):
            continue
        for line, text in _string_heads(path):
            if text.startswith("dropped/"):
                strays.append(f"{rel}:{line}")
    assert not strays


def _joined_keys(path: Path) -> list[tuple[int, str]]:
    """(line, source) of every f-string of ``path`` that joins a directory value to a name
    (``f"{SAMPLES}/{name}"``): a key built outside its store."""
    text = path.read_text(encoding="utf-8")
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.JoinedStr) and len(node.values) >= 2 and \
                isinstance(node.values[0], ast.FormattedValue) and \
                isinstance(node.values[1], ast.Constant) and \
                str(node.values[1].value).startswith("/"):
            out.append((node.lineno, ast.get_source_segment(text, node) or ""))
    return out


def test_the_joined_key_scan_sees_the_stores_own():
    assert _joined_keys(ROOT / "strawq/tasks/states.py")


def test_adapter_stores_build_their_keys_through_the_state_table():
    """The verl queue's records (samples, commits, drops, prefixes) are keyed and moved by
    ``strawq.tasks.states.VERL_SAMPLES`` / ``VERL_PREFIXES``: no verl module joins a directory
    and a name itself, and every directory it names is a declared store's."""
    from strawq.tasks.states import STORES

    strays = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith(STORE_USERS):
            strays += [f"{rel}:{line}: {src}" for line, src in _joined_keys(path)]
    assert not strays, strays
    declared = {d for store in STORES for d in store.directories()}
    assert {p.rstrip("/") for p, owner in OWNERS.items() if owner == "strawq/tasks/states.py"} \
        == declared


def test_every_store_move_is_declared():
    from strawq.tasks.states import STORES, VERL_PREFIXES, VERL_SAMPLES

    st = MemoryStorage()
    for store in STORES:
        for (src, dst), what in store.transitions.items():
            assert store.check(src, dst) == what
    VERL_SAMPLES.retire(st, "000000000001~s1", TaskState.BATCHED, TaskState.TRAINED)
    st.publish(VERL_SAMPLES.key(TaskState.READY, "000000000002~s2"), b"x")
    moved = VERL_SAMPLES.move(st, "000000000002~s2", TaskState.READY, TaskState.DROPPED,
                              "000000000002~s2~queue_full")
    assert moved == "drops/000000000002~s2~queue_full"
    with pytest.raises(IllegalTransition):
        VERL_SAMPLES.move(st, "x", TaskState.DROPPED, TaskState.READY)
    with pytest.raises(IllegalTransition):  # a prefix has no BATCHED state
        VERL_PREFIXES.check(TaskState.LEASED, TaskState.BATCHED)
    with pytest.raises(IllegalTransition):
        VERL_PREFIXES.move(st, "p~1", TaskState.LEASED, TaskState.READY)  # an exit: retire


#: an "over η?" comparison written by hand: a staleness against η
_HAND_JUDGED = re.compile(
    r"(<=|>=|<|>)\s*\(?(int\()?(cfg\.|self\.config\.|policy\.|config\.)?(max_staleness|eta)\b"
    r"|\bstaleness\([^)]*\)\s*(<=|>=|<|>)")


def test_over_eta_is_judged_in_one_place():
    strays = []
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel == "strawq/tasks/eta.py" or rel.startswith("demo/"):
            continue  # demo/ measures shares of trained staleness for reports
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if _HAND_JUDGED.search(code) and not code.lstrip().startswith(("f\"", "\"", "msg")):
                strays.append(f"{rel}:{i}: {line.strip()}")
    assert not strays, strays


def test_eta_mode_vocabulary_is_declared_once():
    from strawq.collector.config import ETA_MODES, CollectorConfig

    assert ETA_MODES is MODES
    assert CollectorConfig.__dataclass_fields__["eta_mode"].type == "EtaMode"
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        if rel == "strawq/tasks/eta.py":
            continue
        text = path.read_text(encoding="utf-8")
        assert not re.search(r"Literal\[\s*\"train\",\s*\"regenerate\"", text), rel


#: the one module that zero-pads numbers into names and reads them back; each family is
#: declared by its owner (``MANIFESTS = Numbered()`` in ``strawq/delivery/batches.py``)
NUMBERED = "strawq/ondisk/numbered.py"
#: core modules that read digits for something other than a numbered name, and what
DIGITS_READ_ELSEWHERE = {
    "strawq/delivery/packed.py": "the unpadded w<W>~r<rank> after a shard's number",
    "strawq/delivery/retention.py": "the generation of a data/<id>~g<gen> record"
                                    " (strawq.ondisk.names)",
    "strawq/storage/posix.py": "the pid of a lock's owner",
    "strawq/doctor/juicefs.py": "the pids under /proc",
}


def _core() -> list[Path]:
    """The core's modules (``tests/test_layering.py``: less the testing and app layers)."""
    return [p for p in _sources() if p.relative_to(ROOT).parts[0] == "strawq"
            and p.relative_to(ROOT).parts[1] not in ("testing", "app", "__main__.py")]


def _zero_padded(path: Path) -> list[int]:
    """Lines of ``path`` that zero-pad a decimal: ``f"{n:012d}"``, ``f"{n:0{w}d}"``,
    ``"%05d"``, ``"{:012d}"``, ``.zfill(``."""
    text = path.read_text(encoding="utf-8")
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FormattedValue) and isinstance(node.format_spec, ast.JoinedStr):
            spec = "".join(v.value if isinstance(v, ast.Constant) else "9"
                           for v in node.format_spec.values)
            if re.fullmatch(r"0\d+d", spec):
                out.append(node.lineno)
    out += [i for i, line in enumerate(text.splitlines(), 1)
            if re.search(r"%0\d+d|\{:0\d+d\}|\.zfill\(", line)]
    return out


def test_numbers_are_padded_by_the_numbered_helper_only():
    """Numbered names are spelled through ``strawq.ondisk.numbered.Numbered``: a hand-rolled
    ``f"{seq:012d}"`` in the core fails here."""
    found = {p.relative_to(ROOT).as_posix(): _zero_padded(p) for p in _core()}
    assert found.pop(NUMBERED), "the scan must see the helper's own formats"
    assert not {rel: lines for rel, lines in found.items() if lines}


def test_numbered_names_are_read_by_the_helper_only():
    """The parse side: no core module checks digits by hand (``name[len(PREFIX):]
    .isdigit()``) but the ones listed, which read numbers that are not numbered names."""
    strays = []
    for path in _core():
        rel = path.relative_to(ROOT).as_posix()
        if rel == NUMBERED or rel in DIGITS_READ_ELSEWHERE:
            continue
        for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if ".isdigit()" in line:
                strays.append(f"{rel}:{i}: {line.strip()}")
    assert not strays, strays
    stale = [rel for rel in DIGITS_READ_ELSEWHERE
             if ".isdigit()" not in (ROOT / rel).read_text(encoding="utf-8")]
    assert not stale, f"no longer read digits: drop them from the list: {stale}"


# -- behaviour of the owners -----------------------------------------------------------------
def _queue() -> RunQueue:
    return RunQueue.create(MemoryStorage())


def test_high_water_marks_only_move_up_and_keep_one():
    st = _queue().storage
    assert high_water(st) == 0
    mark_high_water(st, 3)
    mark_high_water(st, 7)
    assert high_water(st) == 7
    assert [n for n in st.list("collector") if "7" in n] and len(
        [n for n in st.list("collector") if n.endswith(("3", "7")) and n[0] == "b"]) == 1


def test_batch_numbers_continue_after_retired_manifests():
    q = _queue()
    store = BatchStore(q)
    store.publish_batch(1, [])
    store.ack(1)
    assert batch_seqs(q.storage) == ([1], {1})
    store.retire(1)
    assert batch_seqs(q.storage) == ([], set())
    assert not q.storage.exists(manifest_key(1)) and not q.storage.exists(ack_key(1))
    assert store.next_seq() == 2


def test_delivery_marks_keep_the_newest_version_and_prune():
    q = _queue()
    st = q.storage
    store = BatchStore(q)
    mark_delivered(st, 4, 2)
    mark_delivered(st, 4, 5)  # delivered again to a restored trainer
    mark_delivered(st, 5, 5)
    assert delivered(st) == {4: 5, 5: 5}
    store.prune_delivered(6, present=[5], acked=[])  # 5 is unacked: still needed
    assert delivered(st) == {5: 5}
    store.prune_delivered(6, present=[5], acked=[5])
    assert delivered(st) == {}


def test_epoch_family_round_trip():
    st = MemoryStorage()
    st.makedirs("collector")
    for e in (1, 2, 3):
        st.publish(epoch_key(e), b"")
    st.publish(heartbeat_key(3, 9), b"")
    st.publish(closed_key(1), b"")
    mark_epoch_start(st, 3, 12)
    names = list_names(st)
    assert epochs(names) == [1, 2, 3]
    assert heartbeat_counter(names, 3) == 9 and heartbeat_counter(names, 2) == 0
    assert epoch_starts(st) == [(3, 12)]
    assert sorted(prunable(names, 1)) == sorted([epoch_key(1), closed_key(1)])


def test_compaction_is_a_declared_exit():
    check_transition(TaskState.DROPPED, TaskState.COMPACTED)
    assert TaskState.COMPACTED in RETIRED
    with pytest.raises(IllegalTransition):
        check_transition(TaskState.READY, TaskState.COMPACTED)
    st = _queue().storage
    name = TaskName.parse("b000000000000.000000000003~i000000000003~g0~a1~r-1~bad")
    with pytest.raises(IllegalTransition):
        move(st, name, TaskState.DROPPED, TaskState.COMPACTED)
    st.publish(key_of(TaskState.DROPPED, name), b"x")
    retire(st, name, TaskState.DROPPED, TaskState.COMPACTED)
    assert not st.exists(key_of(TaskState.DROPPED, name))


def test_compact_drops_retires_through_the_state_table(monkeypatch):
    q = _queue()
    st = q.storage
    name = TaskName.parse("b000000000000.000000000003~i000000000003~g0~a1~r-1~bad")
    st.publish(key_of(TaskState.DROPPED, name), b"x")
    calls = []
    import strawq.delivery.retention as retention

    real = retention.retire

    def spy(storage, n, src, dst, **kw):  # type: ignore[no-untyped-def]
        calls.append((n.id, src, dst))
        real(storage, n, src, dst, **kw)

    monkeypatch.setattr(retention, "retire", spy)
    assert compact_drops(st) == 1
    assert calls == [("i000000000003", TaskState.DROPPED, TaskState.COMPACTED)]
    assert drop_totals(st) == {"bad": 1}


# -- the one η judgement -----------------------------------------------------------------------
def test_over_is_the_bound_and_nothing_else():
    p = EtaPolicy(1, "drop")
    assert not p.over(5, 4) and p.over(5, 3)
    assert list(p.over_each(5, np.array([5, 4, 3, 0]))) == [False, False, True, True]
    unbounded = EtaPolicy(None)
    assert not unbounded.over(100, 0)
    assert not unbounded.over_each(9, np.array([0, 1])).any()
    assert EtaPolicy(1, "off").over(5, 3) and not EtaPolicy(1, "off").judges


def test_requeue_is_regenerate_everywhere():
    old = EtaPolicy(0, "requeue")
    assert old.mode == "regenerate"
    assert old.action(3, 0) == "regenerate"
    # the attempt cap applies under either name
    assert old.action(3, 0, attempts=3, max_attempts=3) == "train"
    assert EtaPolicy(0, "regenerate").action(3, 0, attempts=3, max_attempts=3) == "train"


def test_policy_round_trips_through_manifest_meta():
    p = EtaPolicy(2, "drop", 4)
    back = EtaPolicy.from_meta({**p.to_meta(), "epoch": 4})
    assert back == p
    assert EtaPolicy.from_meta({}) == EtaPolicy(None)
