"""The training step keeps the GPU fed: a loader batch reaches the device without a host sync, and the
model's training forward and backward read no tensor value back to the host.

On a GPU a read-back (`.item()`, `int(t)`, `bool(t)`, `.tolist()`) or a copy from pageable memory waits
for everything queued before it, and the GPU then idles while the host launches the next kernels. On the
CPU the same calls are detected by patching the readers while the model runs."""
import contextlib

import pytest
import torch

from models import build_model
from pretrain.batches import device_batch, to_device
from pretrain.config import OptimConfig
from pretrain.train_module import TorchTrainModule

ARCHS = ["llama", "tnl", "hgrn2", "cos2"]


@contextlib.contextmanager
def no_value_reads():
    """Any tensor value read back to the host inside raises AssertionError."""
    names = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(name):
        def read(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{name} read a value back to the host")
        return read
    try:
        for n in names:
            setattr(torch.Tensor, n, refuse(n))
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def _batch(vocab: int, rows: int = 2, seq: int = 37, seed: int = 0) -> dict:
    x = torch.randint(0, vocab, (rows, seq + 1), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": x[:, :-1].contiguous(), "targets": x[:, 1:].contiguous()}


def test_the_readers_are_caught():
    t = torch.ones(3)
    with no_value_reads():
        for read in (lambda: t.sum().item(), lambda: int(t[0]), lambda: bool(t[0]), lambda: t.tolist()):
            with pytest.raises(AssertionError, match="read a value back"):
                read()
    assert t.sum().item() == 3.0  # restored


@pytest.mark.parametrize("impl", ["auto", "triton"])
@pytest.mark.parametrize("arch", ARCHS)
def test_training_forward_and_backward_read_no_values(arch, impl):
    """With ids checked on the host (check_ids=False) a micro-batch's forward and backward read nothing
    back, through the PyTorch twins and through the Triton ops' host code (plan, launches; the kernels
    run in the interpreter); the model's own check of the same ids does (a host sync on a GPU)."""
    import ops
    from ops.optional import HAVE_TRITON
    if impl == "triton" and (arch == "llama" or not HAVE_TRITON):
        pytest.skip("LLaMA runs no linear-attention op" if arch == "llama" else "Triton is not installed")
    model = build_model(arch, "tiny")
    module = TorchTrainModule(model, OptimConfig(), torch.device("cpu"), "fp32")
    moved = device_batch(_batch(model.config.vocab_size), torch.device("cpu"), model.config.vocab_size)
    assert moved["check_ids"] is False
    before = ops.get_config().impl
    ops.set_config(impl=impl)
    try:
        with no_value_reads():
            loss = module.wrapped(**moved)  # check_ids=False: checked on the host
            loss.backward()
    finally:
        ops.set_config(impl=before)
    assert torch.isfinite(loss)
    with no_value_reads(), pytest.raises(AssertionError, match="read a value back"):
        module.wrapped(moved["input_ids"], targets=moved["targets"])


def test_device_batch_checks_ids_on_the_host_with_the_models_message():
    model = build_model("tnl", "tiny")
    V = model.config.vocab_size
    bad = _batch(V)
    bad["input_ids"][1, 5] = V
    module = TorchTrainModule(model, OptimConfig(), torch.device("cpu"), "fp32")
    with pytest.raises(ValueError, match=rf"token ids must lie in \[0, {V}\), got min \d+, max {V}"):
        module.forward_loss(bad)
    bad["input_ids"][1, 5] = -1
    with pytest.raises(ValueError, match=r"got min -1"):
        device_batch(bad, torch.device("cpu"), V)
    # the train module's loss on a good batch is the model's own, checked or not
    good = _batch(V, seed=3)
    torch.testing.assert_close(module.forward_loss(good), model(good["input_ids"], targets=good["targets"]),
                               rtol=0, atol=0)


def test_device_batch_checks_targets_and_document_offsets_on_the_host():
    V = 50
    batch = _batch(V)
    batch["targets"][0, 2] = V + 3
    with pytest.raises(ValueError, match=rf"targets must lie in \[0, {V}\).*e.g. {V + 3}"):
        device_batch(batch, torch.device("cpu"), V)
    batch = _batch(V)
    n = batch["input_ids"].numel()
    batch["cu_seqlens"] = torch.tensor([0, 5, n - 1], dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"end at batch x time = {n}"):
        device_batch(batch, torch.device("cpu"), V)
    batch["cu_seqlens"] = torch.tensor([0, 5, n], dtype=torch.int32)
    assert device_batch(batch, torch.device("cpu"), V)["check_ids"] is False


def test_a_sequence_parallel_segment_is_checked_against_its_whole_sequences():
    """Under --sp N a rank's ids are one of N segments of each sequence while cu_seqlens describes the whole
    sequences (N x the rank's tokens): the host check counts the segments, and still refuses offsets that
    describe neither the segment nor the whole."""
    V = 50
    batch = _batch(V)
    n = batch["input_ids"].numel()
    batch["cu_seqlens"] = torch.tensor([0, 3, n + 1, 2 * n], dtype=torch.int32)
    assert device_batch(batch, torch.device("cpu"), V, segments=2)["check_ids"] is False
    with pytest.raises(ValueError, match=rf"end at batch x time = {n}"):
        device_batch(batch, torch.device("cpu"), V)
    for end in (n, 3 * n):
        batch["cu_seqlens"] = torch.tensor([0, 3, end], dtype=torch.int32)
        with pytest.raises(ValueError, match=rf"end at batch x time x 2 sequence-parallel segments = {2 * n}"):
            device_batch(batch, torch.device("cpu"), V, segments=2)


def test_ids_already_on_the_device_are_left_to_the_models_check():
    ids = torch.zeros(1, 4, dtype=torch.long, device="meta")
    moved = device_batch({"input_ids": ids, "targets": ids}, torch.device("meta"), 10)
    assert moved["check_ids"] is True and moved["input_ids"].device.type == "meta"
    cu = torch.tensor([0, 2, 4])
    assert device_batch({"input_ids": ids, "targets": ids, "cu_seqlens": cu}, torch.device("meta"), 10)["cu_seqlens"] is cu
    assert to_device(cu, torch.device("cpu")) is cu  # nothing to copy


def test_tnl_decays_reach_the_device_once():
    """The decay table is copied to a device at the first forward and reused (a copy at every forward
    waits for the GPU), also when first asked for under inference mode."""
    model = build_model("tnl", "tiny")
    with torch.inference_mode():
        first = model.decays.layer_inputs(model.config.n_layers, "cpu")
    again = model.decays.layer_inputs(model.config.n_layers, torch.device("cpu"))
    assert [d["decay"].data_ptr() for d in first] == [d["decay"].data_ptr() for d in again]
    assert not again[0]["decay"].is_inference()
    from models.tnl import tnl_decays
    torch.testing.assert_close(again[1]["decay"], torch.tensor(tnl_decays(model.config.n_heads, 1, model.config.n_layers),
                                                                 dtype=torch.float64))
    ids = _batch(model.config.vocab_size)["input_ids"]
    model(ids, targets=ids).backward()  # the cached table trains (it needs no gradient)


def test_packed_documents_read_the_lengths_back_once_per_forward(monkeypatch):
    """HGRN2 with packed documents (cu_seqlens): `gated_linear_attn` builds its (sequence, chunk) table
    from the document lengths, a read-back, at the first layer of a forward only; the other layers and
    the backward reuse it. A new cu_seqlens tensor, or the same one changed in place, reads again (the
    cache keys on the live tensor's identity and its version counter). The Triton ops run in the
    interpreter; the loss equals a forward that builds the table at every layer."""
    import traceback

    import ops
    import ops.triton_linear_attn as TLA
    from ops.optional import HAVE_TRITON
    if not HAVE_TRITON:
        pytest.skip("Triton is not installed")
    reads = []
    tolist = torch.Tensor.tolist

    def counting(self, *args):
        if any(f.filename.endswith("triton_linear_attn.py") for f in traceback.extract_stack()[:-1]):
            reads.append(1)
        return tolist(self, *args)
    model = build_model("hgrn2", "tiny")  # 2 blocks
    assert len(model.blocks) >= 2
    batch = _batch(model.config.vocab_size, rows=1, seq=150)
    cu = torch.tensor([0, 40, 41, 150], dtype=torch.int32)
    before = ops.get_config().impl
    ops.set_config(impl="triton")
    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    try:
        TLA._LAST_TABLE.clear()
        loss = model(batch["input_ids"], targets=batch["targets"], cu_seqlens=cu)
        loss.backward()
        assert len(reads) == 1
        again = model(batch["input_ids"], targets=batch["targets"], cu_seqlens=cu.clone())  # a new tensor
        assert len(reads) == 2
        torch.testing.assert_close(again, loss, rtol=0, atol=0)
        same = cu.clone()
        model(batch["input_ids"], targets=batch["targets"], cu_seqlens=same)
        same[1] = 30  # in place: the version counter moves
        moved = model(batch["input_ids"], targets=batch["targets"], cu_seqlens=same)
        assert len(reads) == 4 and not torch.equal(moved, loss)
        # every layer building its own table gives the same loss
        monkeypatch.setattr(TLA, "_LAST_TABLE", type("NoCache", (list,), {"__setitem__": lambda *a: None})())
        fresh = model(batch["input_ids"], targets=batch["targets"], cu_seqlens=cu.clone())
        assert len(reads) == 4 + len(model.blocks)
        torch.testing.assert_close(fresh, loss, rtol=0, atol=0)
    finally:
        ops.set_config(impl=before)


def test_stacked_batches_are_the_batch_of_all_their_rows():
    """Single-row batches joined (what the validation set is built from) equal one batch of those rows,
    cu_seqlens included."""
    from data_pipeline.loader import doc_boundaries, stack_batches
    from data_pipeline.tokenizer import EOT_ID
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 50, (5, 17), generator=g)
    ids[torch.rand(5, 17, generator=g) < 0.15] = EOT_ID
    rows = [{"input_ids": r[None, :-1], "targets": r[None, 1:], "cu_seqlens": doc_boundaries(r[None, :-1])}
            for r in ids]
    got = stack_batches(rows, 16)
    assert torch.equal(got["input_ids"], ids[:, :-1]) and torch.equal(got["targets"], ids[:, 1:])
    assert torch.equal(got["cu_seqlens"], doc_boundaries(ids[:, :-1]))


@pytest.mark.parametrize("doc_reset", [False, True])
def test_validation_loss_does_not_depend_on_the_micro_batch(tmp_path, doc_reset):
    """--micro-batch is a speed setting: the same weights score the same validation loss at any of them
    (the validation set is a fixed number of sequences), with --doc-reset's resets as in training."""
    import json
    from checkpoint_utils import make_dataset, run_flags, run_pretrain
    data = make_dataset(tmp_path / "data")
    val = {}
    for micro in (1, 3):
        out = tmp_path / f"m{micro}"
        extra = ["--eval-every", "1", "--eval-batches", "1"] + (["--doc-reset"] if doc_reset else [])
        run_pretrain(run_flags(out, data, 1, *extra, batch=6, micro=micro))
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        val[micro] = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val[1]) == 1
    assert val[3] == pytest.approx(val[1], rel=1e-5)


def _validation_set(data, seq_len: int, eval_batches: int, micro: int = 4) -> list[dict]:
    from types import SimpleNamespace
    from data_pipeline import build_loader
    from pretrain.trainer import Trainer
    train = SimpleNamespace(seq_len=seq_len, eval_batches=eval_batches, micro_batch=micro, seed=0, doc_reset=False)
    fake = SimpleNamespace(cfg=SimpleNamespace(data=str(data), train=train), _sp_segment=lambda: {})
    return Trainer._validation_batches(fake, build_loader)


def test_validation_set_ends_at_the_val_splits_first_repeat(tmp_path, caplog):
    """--eval-batches past what the val split holds: the set is the split's distinct windows, each once
    (not the split's documents again in a second epoch, weighted twice), and the log says so."""
    import json
    from checkpoint_utils import make_dataset
    data = make_dataset(tmp_path / "data")
    total = json.loads((data / "val" / "meta.json").read_text())["sources"][0]["tokens"]
    seq = 64
    batches = _validation_set(data, seq, eval_batches=100)
    ids = torch.cat([b["input_ids"] for b in batches])
    targets = torch.cat([b["targets"] for b in batches])
    assert len(ids) == (total - 1) // seq  # every window of seq + 1 tokens inside the first epoch
    assert len({tuple(r.tolist()) for r in ids}) == len(ids)
    assert torch.equal(targets[:-1, -1], ids[1:, 0])  # consecutive windows of one stream, in its order
    assert "holds" in caplog.text and "--eval-batches" in caplog.text

    caplog.clear()
    small = _validation_set(data, seq, eval_batches=1)
    assert sum(len(b["input_ids"]) for b in small) == 8 and "--eval-batches" not in caplog.text
    assert torch.equal(torch.cat([b["input_ids"] for b in small]), ids[:8])
    assert _validation_set(data, total, eval_batches=1) == []  # not one whole window: no validation loss


def test_mean_loss_stops_asking_at_the_last_batch():
    from pretrain.train_module import mean_loss
    seen, asked = [], []
    stop_after = {"at": 2}

    def stop():
        asked.append(len(seen))
        return len(seen) >= stop_after["at"]
    batches = [{"v": float(v)} for v in (1, 2, 3, 4)]
    forward = lambda b: (seen.append(b["v"]), torch.tensor(b["v"]))[1]  # noqa: E731
    assert mean_loss(forward, batches, stop) is None and seen == [1.0, 2.0]
    seen.clear(); asked.clear()
    stop_after["at"] = 4
    assert mean_loss(forward, batches, stop) == pytest.approx(2.5) and asked == [1, 2, 3]
    assert mean_loss(forward, batches) == pytest.approx(2.5)


def test_a_stop_signal_during_validation_ends_the_pass_and_saves(tmp_path):
    """SIGTERM while the validation set is scored: the pass ends after the batch in flight (Slurm kills
    the job at the end of its grace time), the step's row has no val_loss, and the run saves and stops."""
    import json
    import os
    import signal
    from checkpoint_utils import make_dataset, run_flags
    from pretrain.callbacks import Callback
    from pretrain.config import parse_config
    from pretrain.trainer import Trainer
    data = make_dataset(tmp_path / "data")
    out = tmp_path / "run"
    calls = []

    class TermBeforeSecondEval(Callback):
        def pre_log_metrics(self, progress, row):
            if progress.step == 4:
                calls.append(len(counted))
                os.kill(os.getpid(), signal.SIGTERM)

        def post_step(self, progress):
            if progress.step == 4:
                calls.append(len(counted))

    cfg = parse_config(run_flags(out, data, 8, "--eval-every", "2", "--eval-batches", "3", "--save-every", "100"))
    trainer = Trainer(cfg, callbacks=[TermBeforeSecondEval()])
    counted = []
    forward = trainer.module.forward_loss
    trainer.module.forward_loss = lambda b: (counted.append(1), forward(b))[1]
    summary = trainer.fit()
    assert summary["stop"] == "signal" and summary["step"] == 4
    assert calls[1] - calls[0] == 1  # one of the 24 validation batches, then the pass ended
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "val_loss" in rows[1] and rows[3]["step"] == 4 and "val_loss" not in rows[3]
    assert (out / "checkpoints" / "step_00000004").is_dir()
