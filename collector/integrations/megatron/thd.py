"""Tensor layout for a Megatron-core rank: one shard's columns cut into THD micro-batches.

``ShardPacker`` holds one reader ``Batch``'s columns for the length of one
``MegatronBatcher.micro_batches`` call and builds each planned micro-batch: views of the
reader's tensors where nothing is padded (one ``torch.split`` per column for the whole plan),
else one gather per column that pads every sequence to the layout's multiples, keeps this CP
rank's two chunks of each, and shifts the label-aligned columns by one (the module docstring
of ``adapter`` states the layout).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from strawq.collector.integrations.megatron.micro_batch import (COLUMN_NAMES, COLUMNS, Align,
                                                                 MicroBatch, make_micro_batch)
from strawq.collector.integrations.megatron.planning import ParallelLayout, round_up
from strawq.collector.trainer.importance import LossTotals


@dataclass
class ShardPacker:
    """One rank's shard of a batch, being cut into micro-batches (one per call of
    ``MegatronBatcher.micro_batches``)."""

    layout: ParallelLayout
    pad_token_id: int
    #: Megatron-core's ``PackedSeqParams`` class
    psp: Any
    #: the per-token columns (``COLUMN_NAMES``) and extras over the shard's packed tokens
    cols: dict[str, torch.Tensor]
    ext: dict[str, torch.Tensor]
    align: dict[str, Align]
    #: int64 [S + 1]: the samples' token offsets
    cu: np.ndarray
    totals: LossTotals
    #: per sample [S]: the columns ``MicroBatch.sample_columns`` slices
    samples: dict[str, torch.Tensor]
    cu32: np.ndarray = field(init=False)
    lens: np.ndarray = field(init=False)
    lens_t: torch.Tensor = field(init=False)
    ids_t: torch.Tensor = field(init=False)
    #: each column and extra as [1, T, ...], by the id of the tensor
    rows: dict[int, torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        self.rows = {id(t): t.unsqueeze(0) for t in (*self.cols.values(), *self.ext.values())}
        self.cu32 = self.cu.astype(np.int32)
        self.lens = np.diff(self.cu)
        self.lens_t = torch.from_numpy(self.lens.astype(np.int32))
        self.ids_t = torch.arange(self.lens.shape[0], dtype=torch.int64)

    def build(self, a: int, b: int) -> MicroBatch:
        """The micro-batch of samples ``[a, b)``."""
        lay = self.layout
        cu = self.cu
        start, end = int(cu[a]), int(cu[b])
        if lay.seq_multiple == 1 and (end - start) % lay.tail_multiple == 0:
            # the common case, kept to a few cheap calls: no padding, views of the columns
            fields, extras = self._views(start, end)
            cu_t = torch.from_numpy(self.cu32[a:b + 1] - self.cu32[a])
            max_len = int(self.lens[a:b].max())
            psp = self.psp(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t,
                            cu_seqlens_q_padded=cu_t, cu_seqlens_kv_padded=cu_t,
                            max_seqlen_q=max_len, max_seqlen_kv=max_len)
            lens_t = self.lens_t[a:b]
            return make_micro_batch(fields, packed_seq_params=psp, sample_ids=self.ids_t[a:b],
                              seqlens=lens_t, padded_seqlens=lens_t, extras=extras,
                              totals=self.totals,
                              sample_columns={k: v[a:b] for k, v in self.samples.items()})
        lens = self.lens[a:b]
        plens = round_up(lens, lay.seq_multiple)
        real = int(plens.sum())
        tail = (-real) % lay.tail_multiple
        seq_cu = np.zeros(lens.shape[0] + 1 + (tail > 0), dtype=np.int32)
        np.cumsum(lens, out=seq_cu[1:lens.shape[0] + 1])
        pad_cu = np.zeros_like(seq_cu)
        np.cumsum(plens, out=pad_cu[1:lens.shape[0] + 1])
        if tail:
            seq_cu[-1] = seq_cu[-2] + tail
            pad_cu[-1] = pad_cu[-2] + tail
        max_len = int(max(plens.max(initial=0), tail))
        fields, extras, positions = self._gather(a, b, plens, tail)
        cu_t = torch.from_numpy(seq_cu)
        pad_t = torch.from_numpy(pad_cu)
        psp = self.psp(qkv_format="thd", cu_seqlens_q=cu_t, cu_seqlens_kv=cu_t,
                        cu_seqlens_q_padded=pad_t, cu_seqlens_kv_padded=pad_t,
                        max_seqlen_q=max_len, max_seqlen_kv=max_len)
        return make_micro_batch(fields, packed_seq_params=psp,
                          sample_ids=torch.arange(a, b, dtype=torch.int64),
                          seqlens=torch.from_numpy(lens.astype(np.int32)),
                          padded_seqlens=torch.from_numpy(plens.astype(np.int32)),
                          extras=extras, totals=self.totals,
                          sample_columns={k: v[a:b] for k, v in self.samples.items()},
                          cp_size=lay.cp_size, _positions=positions)

    def all_views(self, parts: list[tuple[int, int]]) -> list[MicroBatch]:
        """No padding, no CP split, for every micro-batch at once: each column is split into
        views with one call (the parts cover the shard's tokens end to end); the shifted
        columns copy only their last part, whose last label lies past the data."""
        cols, ext, align = self.cols, self.ext, self.align
        cu, cu32, k = self.cu, self.cu32, len(parts)
        starts = np.fromiter((a for a, _ in parts), dtype=np.int64, count=k)
        counts = np.fromiter((b - a for a, b in parts), dtype=np.int64, count=k)
        sizes = np.diff(cu[np.append(starts, cu.shape[0] - 1)]).tolist()
        pad = self.pad_token_id

        def split(t: torch.Tensor, shifted: bool, fill: float) -> list[torch.Tensor]:
            row = self.rows[id(t)]  # [1, T, ...]
            if not shifted:
                return list(torch.split(row, sizes, dim=1))
            out = list(torch.split(row[:, 1:], [*sizes[:-1], sizes[-1] - 1], dim=1))
            last = row.new_empty((1, sizes[-1], *t.shape[1:]))
            last[0, :-1] = out[-1][0]
            last[0, -1] = fill
            out[-1] = last
            return out

        fields = {name: split(cols[name], shifted, pad if name in ("tokens", "labels") else fill)
                  for name, fill, shifted in COLUMNS}
        extras = {n: split(t, align[n] == "target", 0) for n, t in ext.items()}
        # each part's cu_seqlens: its boundaries [a, b] minus its first token offset
        span = counts + 1
        first = np.repeat(np.cumsum(span) - span, span)
        idx = np.arange(int(span.sum()), dtype=np.int64) - first + np.repeat(starts, span)
        local = cu32[idx] - np.repeat(cu32[starts], span)
        cus = torch.split(torch.from_numpy(local), span.tolist())
        maxes = np.maximum.reduceat(self.lens, starts).tolist()
        lens = torch.split(self.lens_t, counts.tolist())
        ids = torch.split(self.ids_t, counts.tolist())
        per_sample = {n: torch.split(v, counts.tolist()) for n, v in self.samples.items()}
        psp_cls = self.psp
        out = []
        for i in range(k):
            c = cus[i]
            psp = psp_cls(qkv_format="thd", cu_seqlens_q=c, cu_seqlens_kv=c,
                          cu_seqlens_q_padded=c, cu_seqlens_kv_padded=c,
                          max_seqlen_q=maxes[i], max_seqlen_kv=maxes[i])
            out.append(make_micro_batch(
                {name: fields[name][i] for name in COLUMN_NAMES},
                packed_seq_params=psp, sample_ids=ids[i], seqlens=lens[i],
                padded_seqlens=lens[i], extras={n: v[i] for n, v in extras.items()},
                totals=self.totals, sample_columns={n: v[i] for n, v in per_sample.items()}))
        return out

    def _views(self, start: int, end: int
               ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """No padding, no CP split: views of the reader's tensors (the shifted ones copy only
        for the shard's last micro-batch, whose last label lies past the data)."""
        cols, ext, align, rows = self.cols, self.ext, self.align, self.rows

        def cut(t: torch.Tensor, shifted: bool, fill: float) -> torch.Tensor:
            t2 = rows[id(t)]  # [1, T, ...]: one slicing call per column
            if not shifted:
                return t2[:, start:end]
            if end < t.shape[0]:
                return t2[:, start + 1:end + 1]
            out = t2.new_empty((1, end - start, *t.shape[1:]))
            out[0, :end - start - 1] = t[start + 1:end]
            out[0, end - start - 1] = fill
            return out

        pad = self.pad_token_id
        fields = {name: cut(cols[name], shifted, pad if name in ("tokens", "labels") else fill)
                  for name, fill, shifted in COLUMNS}
        extras = {k: cut(t, align[k] == "target", 0) for k, t in ext.items()}
        return fields, extras

    def _gather(self, a: int, b: int, plens: np.ndarray, tail: int
                ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
        """Padding and/or the CP split: one index per alignment, one gather per column."""
        cols, ext, align, cu, lay = self.cols, self.ext, self.align, self.cu, self.layout
        cp, r = lay.cp_size, lay.cp_rank
        starts = cu[a:b]
        lens = cu[a + 1:b + 1] - starts
        n = lens.shape[0]
        if cp > 1:
            # chunk r and chunk 2cp-1-r of every padded sequence
            chunk = plens // (2 * cp)
            run_seq = np.repeat(np.arange(n), 2)
            run_off = np.empty(2 * n, dtype=np.int64)
            run_off[0::2] = r * chunk
            run_off[1::2] = (2 * cp - 1 - r) * chunk
            run_len = np.repeat(chunk, 2)
        else:
            run_seq = np.arange(n)
            run_off = np.zeros(n, dtype=np.int64)
            run_len = plens
        total = int(run_len.sum())
        run_start = np.zeros(run_len.shape[0], dtype=np.int64)
        np.cumsum(run_len[:-1], out=run_start[1:])
        seq_of = np.repeat(run_seq, run_len)
        # offset of each output position within its (padded) sequence
        j = np.arange(total, dtype=np.int64) - np.repeat(run_start - run_off, run_len)
        t_len = int(cols["tokens"].shape[0])
        lo, hi = int(starts[0]), min(int(cu[b]) + 1, t_len)  # the sources this part reads
        fill_at = hi - lo  # index of the fill row appended after them
        ok_in = j < lens[seq_of]
        src_in = np.where(ok_in, starts[seq_of] + j - lo, fill_at)
        src_tg = np.where(ok_in & (src_in + 1 + lo < t_len), src_in + 1, fill_at)
        if tail:
            # the tail padding sequence, split like the others (chunks r and 2cp-1-r)
            if cp > 1:
                c = tail // (2 * cp)
                j_tail = np.concatenate([np.arange(r * c, (r + 1) * c),
                                         np.arange((2 * cp - 1 - r) * c, (2 * cp - r) * c)])
            else:
                j_tail = np.arange(tail)
            tail_fill = np.full(j_tail.shape[0], fill_at, dtype=np.int64)
            j = np.concatenate([j, j_tail.astype(np.int64)])
            src_in = np.concatenate([src_in, tail_fill])
            src_tg = np.concatenate([src_tg, tail_fill])
        idx = {False: torch.from_numpy(src_in), True: torch.from_numpy(src_tg)}

        def take(t: torch.Tensor, shifted: bool, fill: float) -> torch.Tensor:
            ext = torch.cat([t[lo:hi], t.new_full((1, *t.shape[1:]), fill)])
            return ext.index_select(0, idx[shifted]).unsqueeze(0)

        pad = self.pad_token_id
        fields = {name: take(cols[name], shifted, pad if name in ("tokens", "labels") else fill)
                  for name, fill, shifted in COLUMNS}
        extras = {k: take(t, align[k] == "target", 0) for k, t in ext.items()}
        return fields, extras, torch.from_numpy(j).view(1, -1)
