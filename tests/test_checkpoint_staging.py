"""The pieces behind one-pass background saves: host staging arenas (copies that share nothing with the
live state, reused between saves, page-locked a piece at a time), files hashed while they are written
(the checksum equals a read-back's; safetensors and torch files stay loadable), and the manifest taking
those checksums instead of reading the files again while still catching damaged files."""
from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
import torch

import checkpoints.manifest as manifest_mod
from checkpoints import cuda_host, staging
from checkpoints.hashio import FileRecord, save_safetensors, save_torch
from checkpoints.manifest import file_checksum, verify, write_manifest
from checkpoints.staging import PAGE, StagingBuffers


def nested_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    model = collections.OrderedDict(w=torch.randn(37, 11, generator=g), b=torch.randn(11, generator=g).bfloat16())
    model._metadata = {"": {"version": 1}}
    return {"model": model,
            "optimizer": {"state": {0: {"step": torch.tensor(float(seed)), "exp_avg": torch.randn(3000, generator=g)}},
                          "param_groups": [{"lr": 0.1, "params": [0]}]},
            "misc": (torch.arange(5, dtype=torch.int64) + seed, [torch.zeros(0), torch.ones(2, 2, dtype=torch.bool)]),
            "n": seed}


def flat(obj) -> list[torch.Tensor]:
    return list(staging.tensors_in(obj))


def test_stage_copies_exactly_shares_nothing_and_reuses_its_buffer():
    buf = StagingBuffers(piece_bytes=PAGE)  # tiny pieces: tensors straddle piece boundaries
    state = nested_state(1)
    staged = buf.stage(state)
    assert type(staged["model"]) is collections.OrderedDict and staged["model"]._metadata == {"": {"version": 1}}
    assert staged["optimizer"]["param_groups"] == state["optimizer"]["param_groups"] and staged["n"] == 1
    assert isinstance(staged["misc"], tuple) and isinstance(staged["misc"][1], list)
    for src, dst in zip(flat(state), flat(staged)):
        assert dst.dtype == src.dtype and dst.shape == src.shape and torch.equal(dst, src)
        assert src.numel() == 0 or dst.data_ptr() != src.data_ptr()
    ptrs = [t.data_ptr() for t in flat(staged)]
    for t in flat(state):  # training goes on: the staged copy must not change
        if t.numel() and t.dtype != torch.bool:
            t.add_(1)
    assert torch.equal(staged["model"]["w"], nested_state(1)["model"]["w"])
    again = buf.stage(nested_state(2))  # same layout: same memory, new values
    assert [t.data_ptr() for t in flat(again)] == ptrs
    assert all(torch.equal(a, b) for a, b in zip(flat(again), flat(nested_state(2))))
    other = buf.stage({"x": torch.ones(3)})  # another layout under the same key: a new arena
    assert torch.equal(other["x"], torch.ones(3))


def test_stage_keeps_the_types_of_tuple_subclasses():
    """DeepSpeed's ZeRO-3 model states hold each parameter's shape as a torch.Size (a tuple subclass), and
    zero_to_fp32 calls .numel() on it: a staged copy must keep the type, not turn it into a plain tuple."""
    shapes = collections.OrderedDict(w=torch.Size([37, 11]), b=torch.Size([11]))
    Pair = collections.namedtuple("Pair", "a b")
    staged = StagingBuffers().stage({"param_shapes": [shapes], "pair": Pair(torch.ones(2), torch.Size([2])),
                                     "plain": (torch.zeros(1), 3)})
    assert [type(s) for s in staged["param_shapes"][0].values()] == [torch.Size, torch.Size]
    assert staged["param_shapes"][0]["w"].numel() == 37 * 11
    assert type(staged["pair"]) is Pair and type(staged["pair"].b) is torch.Size
    assert type(staged["plain"]) is tuple and staged["plain"][1] == 3


def test_reserve_prepares_the_arena_stage_then_uses():
    buf = StagingBuffers(piece_bytes=PAGE)
    state = nested_state(3)
    buf.reserve(state)
    arena = buf._arenas[""]
    assert arena.touched == arena.pieces and arena.pieces == -(-arena.nbytes // PAGE)
    staged = buf.stage(state)
    assert buf._arenas[""] is arena and staged["optimizer"]["state"][0]["exp_avg"].data_ptr() == \
        arena.views[3].data_ptr()


def test_pinning_goes_piece_by_piece_within_its_budget_and_is_undone(monkeypatch):
    """cudaHostRegister is faked (no GPU here): pieces are page aligned, registered in order, at least one
    per call and no more than the time budget allows, and all unregistered when the buffers go."""
    registered, unregistered = [], []
    monkeypatch.setattr(cuda_host, "available", lambda: True)
    monkeypatch.setattr(cuda_host, "register", lambda ptr, n: registered.append((ptr, n)) or True)
    monkeypatch.setattr(cuda_host, "unregister", lambda ptr: unregistered.append(ptr))
    buf = StagingBuffers(piece_bytes=4 * PAGE)
    buf.reserve({"a": torch.empty(10 * PAGE + 3, dtype=torch.uint8), "b": torch.empty(7, dtype=torch.float64)})
    buf._arenas[""].pinnable = True  # the sources here are CPU tensors; pretend they were on a GPU
    assert buf.pin_some(0.0) == 1 and len(registered) == 1  # no time left: still one piece
    while not buf.fully_pinned:
        buf.pin_some(10.0)
    arena = buf._arenas[""]
    # 10 pages + 3 bytes (rounded up to 64) + 56 bytes (64): 11 pages in pieces of 4
    assert [n for _, n in registered] == [4 * PAGE, 4 * PAGE, 3 * PAGE]
    assert all(p % PAGE == 0 for p, _ in registered)
    assert [p for p, _ in registered] == [registered[0][0] + i * 4 * PAGE for i in range(3)]
    base = arena.storage.data_ptr()
    assert base <= registered[0][0] and registered[-1][0] + registered[-1][1] <= base + arena.storage.numel()
    assert buf.pin_some(10.0) == 0 and buf.stats()["pinned"] == 3
    buf.release()
    assert sorted(unregistered) == sorted(p for p, _ in registered)


def test_pinning_is_a_no_op_without_cuda():
    buf = StagingBuffers()
    buf.stage({"x": torch.ones(10)})
    assert buf.fully_pinned and buf.pin_some(1.0) == 0


def test_torch_file_hashed_while_written_matches_a_read_back(tmp_path):
    state = StagingBuffers().stage(nested_state(4))
    rec = save_torch(state, tmp_path / "s.pt")
    # each staged tensor has a storage of its own: the file holds only its tensors, not the whole arena
    torch.save(nested_state(4), tmp_path / "plain.pt")
    assert rec.size < 1.1 * (tmp_path / "plain.pt").stat().st_size
    rec_model = save_torch(state["model"], tmp_path / "model.pt")
    assert rec_model.size < 0.5 * rec.size
    assert rec.size == (tmp_path / "s.pt").stat().st_size
    assert rec.checksum == file_checksum(tmp_path / "s.pt", rec.algo)
    back = torch.load(tmp_path / "s.pt", weights_only=False)
    assert all(torch.equal(a, b) for a, b in zip(flat(back), flat(state)))


def test_safetensors_written_by_us_loads_with_safetensors(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file
    tensors = {"emb": torch.randn(5, 3), "h": torch.randn(4).bfloat16(), "i": torch.arange(6).reshape(2, 3),
               "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5)}
    rec = save_safetensors(tensors, tmp_path / "m.safetensors")
    assert rec.checksum == file_checksum(tmp_path / "m.safetensors", rec.algo)
    back = load_file(str(tmp_path / "m.safetensors"))
    assert back.keys() == tensors.keys()
    for k in tensors:
        assert back[k].dtype == tensors[k].dtype and torch.equal(back[k], tensors[k]), k
    with safe_open(str(tmp_path / "m.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}


def test_manifest_uses_write_time_checksums_and_still_catches_damage(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    root.mkdir()
    rec = save_torch({"x": torch.randn(1000)}, root / "big.pt")
    (root / "meta.json").write_text(json.dumps({"step": 1}))
    reads = []
    real = manifest_mod.file_checksum
    monkeypatch.setattr(manifest_mod, "file_checksum", lambda p, *a, **k: reads.append(Path(p).name) or real(p, *a, **k))
    stale = FileRecord(rec.size + 1, "0" * 32, rec.algo)  # a record that does not fit the file is not trusted
    write_manifest(root, known={"big.pt": rec, "meta.json": stale})
    assert reads == ["meta.json"]  # big.pt was not read back
    monkeypatch.setattr(manifest_mod, "file_checksum", real)
    assert verify(root) is None
    data = bytearray((root / "big.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (root / "big.pt").write_bytes(bytes(data))
    assert "checksum" in verify(root)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_stage_into_pinned_pieces():  # pragma: no cover - GPU only
    buf = StagingBuffers(piece_bytes=1 << 20)
    state = {"a": torch.randn(3_000_001, device="cuda"), "b": torch.randn(7, device="cuda").half()}
    buf.stage(state)
    while not buf.fully_pinned:
        buf.pin_some(1.0)
    staged = buf.stage(state)
    assert all(torch.equal(staged[k].cuda(), state[k]) for k in state)
