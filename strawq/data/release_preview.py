"""What a release would do, read-only: ``preview_release`` (``strawq release --dry-run``)
reads the newest cursor and asks the release planner (``strawq.data.planner``) and the bad-row
judge (``strawq.data.release_check``) what ``Feeder.release`` would release, skip and drop, per
source, without moving the cursor or writing anything. ``check_share`` validates the bad-row
bound both use.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from strawq.data.binding import DatasetMismatch
from strawq.data.cursor import read_cursor_state
from strawq.data.dataset import BadRow, Dataset
from strawq.data.planner import Passes, ReleasePlanner
from strawq.data.release_check import ReleasePreview, preview
from strawq.errors import ConfigError
from strawq.tasks.queue import RunQueue


def check_share(share: float) -> float:
    """``share`` if it is a valid ``max_bad_row_share`` (0..1), else ``ConfigError``."""
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 <= share <= 1:
        raise ConfigError(f"max_bad_row_share must be a number from 0 to 1 (a share of the rows "
                          f"released), got {share!r}")
    return float(share)


def preview_release(queue: RunQueue, dataset: Dataset, count: int | None = None, *,
                    max_bad_row_share: float | None = None) -> ReleasePreview:
    """What ``Feeder(queue, dataset).release(count)`` would release, skip and drop, per
    source, read-only: the cursor does not move and nothing is written or recovered
    (``--dry-run``); a release the bad-row bound would refuse is reported as ``refused``."""
    count = queue.config.release_batch if count is None else count
    share = check_share(queue.config.max_bad_row_share if max_bad_row_share is None
                        else max_bad_row_share)
    if dataset.prompt_key != queue.config.prompt_key:
        raise DatasetMismatch(f"the dataset is read with prompt_key {dataset.prompt_key!r} "
                              f"but the run's is {queue.config.prompt_key!r}")
    state = read_cursor_state(queue.storage) or {"next_index": 0, "fingerprint": {},
                                                 "exhausted": False}
    fp = dict(state.get("fingerprint") or {})
    planner = ReleasePlanner(dataset, queue.config, queue.storage)
    exhausted = bool(state.get("exhausted"))
    nxt = int(state["next_index"])
    passes = Passes.of(state.get("epoch_bases") or (), state.get("epoch_offsets") or (),
                       int(fp.get("base", 0) or 0), dataset.source_count)
    if exhausted and (opened := planner.next_pass(passes, nxt)) is not None:
        # the pass ended, and the next one starts here (``Feeder._next_epoch``)
        fp["base"], exhausted, passes = nxt, False, opened
    judge: dict[str, Any] = {"max_share": share, "window": queue.config.release_batch,
                             "recent": state.get("recent") or (0, 0)}
    got = preview(dataset, fp, nxt, exhausted, count, offsets=passes.offsets[-1], **judge)
    segments = [(passes, got.start, got.end)]
    taken = got.end - got.start
    if got.refused is None and got.exhausted and taken < count \
            and (opened := planner.next_pass(passes, got.end)) is not None:
        # the release runs past the end of this pass into the next, as ``release`` does
        rest = preview(dataset, {**fp, "base": got.end}, got.end, False, count - taken,
                       offsets=opened.offsets[-1], **judge)
        kinds = dict(got.kinds)
        for k, v in rest.kinds.items():
            kinds[k] = kinds.get(k, 0) + v
        segments.append((opened, rest.start, rest.end))
        got = dataclasses.replace(rest, count=count, start=got.start, good=got.good + rest.good,
                                  bad=got.bad + rest.bad, kinds=kinds)
    if got.refused is not None:
        return got
    return dataclasses.replace(got, sources=_by_source(planner, segments))


def _by_source(planner: ReleasePlanner, segments: list[tuple[Passes, int, int]]
               ) -> dict[str, dict[str, int]]:
    """Per source, the rows the release's ``segments`` (one per pass) would release, skip
    and drop: the planner's decisions on the rows, as ``Feeder.release`` takes them."""
    out: dict[str, dict[str, int]] = {}
    for passes, start, end in segments:
        rows = planner.read(passes, start, end - start)
        skipped = {s.index for s in planner.plan(passes, rows).skips}
        for index, row in rows:
            name = planner.origin(passes, index).source or "dataset"
            what = "bad" if isinstance(row, BadRow) else "skip" if index in skipped \
                else "release"
            counts = out.setdefault(name, {"release": 0, "skip": 0, "bad": 0})
            counts[what] += 1
    return out
