"""Attestation's fingerprint (strawq.weights.fingerprint): which slices, the cast both sides
make, the records beside the version, and the local engines' ``/get_weights_by_name`` read
back against the trainer's weights (the real server's: tests/producers/test_attestation_real.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from strawq.errors import StrawqError
from strawq.producers.engines.launch import EngineOptions
from strawq.producers.engines.sim_backend import sim_weights
from strawq.producers.engines.testing import EngineThread
from strawq.producers.engines.tiny_config import TinyConfig
from strawq.producers.engines.tiny_model import init_model, save_weights
from strawq.storage import MemoryStorage
from strawq.weights.fingerprint import (
    AttestationError,
    Fingerprints,
    Slice,
    Verdict,
    attest,
    cast,
    engine_fingerprint,
    fingerprint_of,
    fingerprint_of_checkpoint,
    plan_slices,
    read_parameter,
)

TINY = TinyConfig(vocab_size=64, hidden_size=16, num_layers=3, num_heads=2,
                  intermediate_size=32, context_length=64, seed=3)


def test_slices_cover_each_kind_in_the_first_and_last_layer_and_skip_the_huge() -> None:
    shapes = {f"model.layers.{i}.{k}": (8, 4) for i in range(12)
              for k in ("attn.q.weight", "mlp.down.weight")}
    shapes |= {"model.norm.weight": (4,), "model.embed.weight": (1000, 4096),
               "model.layers.3.only_here.weight": (2,)}
    names = [s.name for s in plan_slices(shapes, rows=2, max_numel=1_000_000)]
    assert names == sorted([
        "model.layers.0.attn.q.weight", "model.layers.11.attn.q.weight",
        "model.layers.0.mlp.down.weight", "model.layers.11.mlp.down.weight",
        "model.layers.3.only_here.weight", "model.norm.weight"])
    assert "model.embed.weight" in {s.name for s in plan_slices(shapes, max_numel=10**8)}


def test_the_bf16_cast_is_torchs() -> None:
    x = torch.randn(4096, dtype=torch.float32) * 3
    ours = cast(x.numpy(), "bfloat16")
    theirs = x.to(torch.bfloat16).float().numpy()
    assert np.array_equal(ours, theirs)
    assert np.array_equal(cast(theirs, "bfloat16"), theirs)  # a bf16 engine's values: exact


def test_fp32_master_weights_match_their_bf16_copy_and_a_change_does_not() -> None:
    w = {"a.weight": torch.randn(3, 5), "b.weight": torch.randn(5)}
    fp = fingerprint_of(w)
    assert fingerprint_of({k: v.to(torch.bfloat16) for k, v in w.items()}).digest == fp.digest
    changed = dict(w, **{"b.weight": w["b.weight"] * 1.05})
    assert fingerprint_of(changed).digest != fp.digest
    with pytest.raises(ValueError, match="do not hold"):
        fingerprint_of({"a.weight": w["a.weight"]}, slices=fp.slices)


def test_records_beside_the_version_newest_verdict_decides() -> None:
    st = MemoryStorage()
    book = Fingerprints(st)
    assert book.attested("http://e", 3) is True  # no fingerprint: attestation off for v3
    fp = fingerprint_of({"x": np.arange(4.0)}, dtype="float32")
    book.publish(3, fp)
    book.publish(3, fp)  # a retry: no-op
    with pytest.raises(StrawqError, match="cannot replace"):
        book.publish(3, fingerprint_of({"x": np.ones(4)}, dtype="float32"))
    assert book.get(3) == fp and book.attested("http://e/", 3) is None
    book.record(Verdict("http://e", 3, False, "bad", fp.digest, at=1.0))
    assert book.attested("http://e", 3) is False
    book.record(Verdict("http://e", 3, True, fp.digest, fp.digest, at=2.0))
    assert book.attested("http://e", 3) is True
    for v in range(4, 9):
        book.publish(v, fp)
    assert book.get(3) is None and not book.verdicts(3)  # old versions' records go


def test_the_tiny_engine_serves_its_parameters_as_sglang_does(tmp_path) -> None:
    model = init_model(TINY)
    save_weights(model, str(tmp_path / "w"))
    e = EngineThread(EngineOptions(kind="tiny", max_running=4, weight_version="0",
                                   model_path=str(tmp_path / "w"), tiny=TINY))
    try:
        state = model.state_dict()
        rows = read_parameter(e.url, "layers.0.wq.weight", 2)
        assert rows.shape == (2, 16)
        assert np.array_equal(rows, state["layers.0.wq.weight"][:2].numpy())
        assert read_parameter(e.url, "norm.weight", 5).shape == (5,)
        with pytest.raises(AttestationError, match="HTTP 400"):
            read_parameter(e.url, "no.such.weight", 1)
        fp = fingerprint_of(state, dtype="float32")
        assert {s.name for s in fp.slices} >= {"layers.0.wq.weight", "layers.2.wq.weight",
                                               "norm.weight", "embed.weight"}
        assert engine_fingerprint(e.url, fp) == fp.digest
        assert attest(e.url, 0, fp).ok
        other = init_model(TinyConfig(**{**TINY.__dict__, "seed": 4}))
        assert not attest(e.url, 0, fingerprint_of(other.state_dict(), dtype="float32")).ok
    finally:
        e.stop()


def test_the_sim_engine_proves_the_path_it_loaded() -> None:
    e = EngineThread(EngineOptions(kind="sim", max_running=4, weight_version="0"))
    try:
        fp = fingerprint_of(sim_weights("sim"), dtype="float32")
        assert fp.slices == (Slice("sim.weights", 1),)
        assert attest(e.url, 0, fp).ok
        assert not attest(e.url, 0, fingerprint_of(sim_weights("/ckpt/v7"),
                                                   dtype="float32")).ok
    finally:
        e.stop()


def test_an_unreachable_engine_fails_saying_why() -> None:
    fp = fingerprint_of({"x": np.arange(3.0)}, dtype="float32")
    v = attest("http://127.0.0.1:9", 1, fp, timeout_s=1.0)
    assert not v.ok and v.found is None and "cannot reach" in (v.error or "")
    assert not v.reachable  # no verdict on its weights: attest_all does not record it


def test_verdicts_of_some_engines_read_only_their_records() -> None:
    """A producer asks for its own engines' verdicts: reading every engine's record of the
    version was O(fleet) reads per producer at every step of a rolling update."""
    reads: list[str] = []

    class Reads(MemoryStorage):
        def read(self, key: str) -> bytes:
            reads.append(key)
            return super().read(key)

    book = Fingerprints(Reads())
    fp = fingerprint_of({"x": np.arange(4.0)}, dtype="float32")
    book.publish(2, fp)
    fleet = [f"http://10.0.{i}.1:30000" for i in range(40)]
    for i, url in enumerate(fleet):
        book.record(Verdict(url, 2, i % 3 != 0, fp.digest, fp.digest, at=1.0))
    book.record(Verdict(fleet[3], 2, True, fp.digest, fp.digest, at=2.0))  # repaired
    reads.clear()
    mine = book.verdicts(2, [fleet[3], fleet[4] + "/"])
    assert {u: v.ok for u, v in mine.items()} == {fleet[3]: True, fleet[4]: True}
    assert len(reads) == 3, reads  # fleet[3]'s two records and fleet[4]'s one
    everyone = book.verdicts(2)
    assert len(everyone) == 40 and not everyone[fleet[0]].ok
    reads.clear()
    assert book.attested(fleet[6], 2) is False and book.attested(fleet[7], 2) is True
    assert sum(k.startswith("attested/") for k in reads) == 2


def _state_dict(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out = {f"model.layers.{i}.mlp.down_proj.weight": torch.randn(6, 4, generator=g)
           for i in range(3)}
    out["model.norm.weight"] = torch.randn(4, generator=g)
    out["lm_head.weight"] = torch.randn(10, 4, generator=g)
    return {k: v.to(dtype) for k, v in out.items()}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_safetensors_checkpoint_fingerprints_as_its_state_dict(tmp_path, dtype) -> None:
    """``fingerprint_of_checkpoint`` (the headers and the slices' first rows only, sharded
    or not) gives the digest ``fingerprint_of`` gives the state dict it holds."""
    st = pytest.importorskip("safetensors.torch")
    w = _state_dict(dtype)
    names = sorted(w)
    st.save_file({n: w[n] for n in names[:2]}, str(tmp_path / "model-00001-of-00002.safetensors"),
                 metadata={"format": "pt"})
    st.save_file({n: w[n] for n in names[2:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    (tmp_path / "config.json").write_text("{}")
    for rows in (1, 3):
        fp = fingerprint_of_checkpoint(tmp_path, rows=rows)
        assert fp == fingerprint_of(w, rows=rows)
        assert fp.dtype == "bfloat16" and len(fp.slices) == 4  # layers 0 and 2, norm, head
    assert fingerprint_of_checkpoint(tmp_path, dtype="float32") == fingerprint_of(
        w, dtype="float32")
    one = tmp_path / "one"
    one.mkdir()
    st.save_file(w, str(one / "model.safetensors"))  # one file, passed as the file itself
    assert fingerprint_of_checkpoint(one / "model.safetensors") == fingerprint_of(w)
    w["lm_head.weight"][0, 0] += 1.0  # a change in a slice's first row: another digest
    st.save_file(w, str(one / "model.safetensors"))
    assert fingerprint_of_checkpoint(one) != fingerprint_of_checkpoint(tmp_path)


def test_a_checkpoint_that_is_not_one_is_refused_clearly(tmp_path) -> None:
    with pytest.raises(ValueError, match="no safetensors checkpoint"):
        fingerprint_of_checkpoint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{nope")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        fingerprint_of_checkpoint(tmp_path)
