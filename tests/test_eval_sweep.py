"""The snapshot sweep: discovery, the per-(snapshot, task) cache, tables and plots."""
import csv
import json
import math
import os
import shutil

import numpy as np
import pytest
import torch

from evaluation import sweep as sw
from models import build_model, save_pretrained


@pytest.fixture
def run_dir(tmp_path):
    torch.manual_seed(0)
    for step in (10, 30):
        save_pretrained(build_model("hgrn2", "tiny", max_seq_len=32), tmp_path / "run_a" / "exports" / f"step_{step:08d}",
                        extra={"step": step, "tokens": step * 100, "flops": step * 1e9})
    return tmp_path / "run_a"


def test_sweep_caches_per_snapshot_and_task(run_dir, tmp_path, monkeypatch):
    shards = tmp_path / "val.bin"
    np.random.default_rng(0).integers(0, 100277, 3 * 17, dtype=np.uint32).tofile(shards)
    calls = []
    real = sw.run_tasks

    def counting(tasks, model, snap, cfg, out):
        calls.append((snap["snapshot"], tuple(tasks)))
        return real(tasks, model, snap, cfg, out)

    monkeypatch.setattr(sw, "run_tasks", counting)
    cfg = sw.SweepConfig(runs=[str(run_dir)], tasks=["valid_loss"], valid_shards=[str(shards)], valid_seq_len=16,
                         out=str(tmp_path / "out"), device="cpu", batch_size=2)
    rows = sw.sweep(cfg)
    assert [r["step"] for r in rows] == [10, 30]
    assert sorted(calls) == [("step_00000010", ("valid_loss",)), ("step_00000030", ("valid_loss",))]
    assert rows[0]["results"]["valid_loss"]["windows"] == 3 and rows[0]["results"]["valid_loss"]["tokens"] == 48

    calls.clear()
    again = sw.sweep(cfg)  # everything cached
    assert calls == []
    assert again[1]["results"] == rows[1]["results"]

    # new weights for one snapshot -> only that one reruns; changed settings -> everything reruns
    w = run_dir / "exports" / "step_00000030" / "model.safetensors"
    os.utime(w, ns=(w.stat().st_atime_ns, w.stat().st_mtime_ns + 10 ** 9))
    sw.sweep(cfg)
    assert calls == [("step_00000030", ("valid_loss",))]
    calls.clear()
    cfg.valid_windows = 2
    sw.sweep(cfg)
    assert len(calls) == 2

    out = tmp_path / "out"
    with open(out / "results.csv") as fh:
        table = list(csv.DictReader(fh))
    assert [int(r["step"]) for r in table] == [10, 30] and float(table[0]["flops"]) == 1e10
    cached = json.loads((out / "cache" / "run_a" / "step_00000010" / "valid_loss.json").read_text())
    assert float(table[0]["valid_loss/windows"]) == 2
    assert float(table[0]["valid_loss/loss"]) == pytest.approx(cached["metrics"]["loss"], rel=1e-12)
    assert json.loads((out / "results.json").read_text())["snapshots"][0]["run"] == "run_a"
    assert (out / "plots" / "valid_loss__loss_vs_compute.png").exists()
    assert (out / "plots" / "valid_loss__loss_vs_tokens.png").exists()
    # one snapshot per run: nothing to draw a line through, so no plots
    sw.sweep(sw.SweepConfig(runs=[str(run_dir / "exports" / "step_00000010")], tasks=["valid_loss"],
                            valid_shards=[str(shards)], valid_seq_len=16, out=str(tmp_path / "one"), device="cpu"))
    assert not (tmp_path / "one" / "plots").exists()


def test_validation_loss_matches_forward_pass():
    from evaluation.scoring import validation_loss
    torch.manual_seed(0)
    model = build_model("tnl", "tiny", vocab_size=300).eval()
    windows = [torch.randint(0, 300, (9,)) for _ in range(3)] + [torch.randint(0, 300, (5,))]
    got = validation_loss(model, windows, batch_size=2)
    with torch.no_grad():
        nll = [torch.nn.functional.cross_entropy(model(w[None, :-1])[0], w[1:], reduction="sum") for w in windows]
    assert got["tokens"] == 8 * 3 + 4
    assert got["loss"] == pytest.approx(float(sum(nll)) / got["tokens"], rel=1e-5)
    # exp of the float64 mean in float64 (a float32 exp is off by ~1e-8, the perplexity good to 7 digits)
    assert got["perplexity"] == pytest.approx(math.exp(got["loss"]), rel=1e-14)


def test_find_snapshots_accepts_export_dirs(run_dir):
    snaps = sw.find_snapshots([str(run_dir / "exports" / "step_00000030")])
    assert len(snaps) == 1 and snaps[0]["run"] == "run_a" and snaps[0]["tokens"] == 3000
    with pytest.raises(FileNotFoundError):
        sw.find_snapshots([str(run_dir / "exports")])



def test_cache_follows_the_dtype_and_the_files_now_matched(run_dir, tmp_path, monkeypatch):
    """A cached result is reused only for the same dtype and the same held-out files: another --dtype, or
    a file added to what --valid-shards matches, runs the task again."""
    rng = np.random.default_rng(1)
    for k in range(2):
        rng.integers(0, 100277, 3 * 17, dtype=np.uint32).tofile(tmp_path / f"v{k}.bin")
    calls = []
    real = sw.run_tasks
    monkeypatch.setattr(sw, "run_tasks", lambda tasks, *a: calls.append(tasks) or real(tasks, *a))
    cfg = sw.SweepConfig(runs=[str(run_dir / "exports" / "step_00000010")], tasks=["valid_loss"],
                         valid_shards=[str(tmp_path / "v*.bin")], valid_seq_len=16, out=str(tmp_path / "out"),
                         device="cpu", batch_size=2)
    first = sw.sweep(cfg)[0]["results"]["valid_loss"]
    assert len(calls) == 1 and first["windows"] == 6
    sw.sweep(cfg)
    assert len(calls) == 1  # cached
    rng.integers(0, 100277, 2 * 17, dtype=np.uint32).tofile(tmp_path / "v2.bin")
    grown = sw.sweep(cfg)[0]["results"]["valid_loss"]
    assert len(calls) == 2 and grown["windows"] == 8
    cfg.dtype = "bfloat16"
    bf16 = sw.sweep(cfg)[0]["results"]["valid_loss"]
    assert len(calls) == 3 and bf16["loss"] != grown["loss"]
    # the same files elsewhere, times kept (a study moved with rsync -a / cp -a): the cached result holds
    moved = tmp_path / "moved"
    moved.mkdir()
    for f in sorted(tmp_path.glob("v*.bin")):
        shutil.copy2(f, moved / f.name)
    cfg.valid_shards = [str(moved / "v*.bin")]
    assert sw.sweep(cfg)[0]["results"]["valid_loss"] == bf16 and len(calls) == 3
    (moved / "v2.bin").write_bytes((moved / "v2.bin").read_bytes())  # rewritten: another time
    sw.sweep(cfg)
    assert len(calls) == 4


def test_runs_of_one_name_in_two_folders_stay_apart(tmp_path):
    torch.manual_seed(0)
    for parent in ("x", "y"):
        save_pretrained(build_model("tnl", "tiny", max_seq_len=32), tmp_path / parent / "tnl" / "exports" / "step_00000010",
                        extra={"step": 10, "tokens": 1000, "flops": 1e10})
    snaps = sw.find_snapshots([str(tmp_path / "x" / "tnl"), str(tmp_path / "y" / "tnl"),
                               str(tmp_path / "y" / "tnl" / "exports" / "step_00000010")])  # the last one twice
    assert sorted(r["run"] for r in snaps) == ["x/tnl", "y/tnl"]


def test_a_damaged_export_is_reported_and_the_others_evaluated(run_dir, tmp_path):
    shards = tmp_path / "val.bin"
    np.random.default_rng(0).integers(0, 100277, 3 * 17, dtype=np.uint32).tofile(shards)
    w = run_dir / "exports" / "step_00000010" / "model.safetensors"
    w.write_bytes(w.read_bytes()[:1000])
    rows = sw.sweep(sw.SweepConfig(runs=[str(run_dir)], tasks=["valid_loss"], valid_shards=[str(shards)],
                                   valid_seq_len=16, out=str(tmp_path / "out"), device="cpu"))
    assert "cannot load" in rows[0]["results"]["valid_loss"]["error"]
    assert rows[1]["results"]["valid_loss"]["windows"] == 3
    with open(tmp_path / "out" / "results.csv") as fh:
        table = list(csv.DictReader(fh))
    # the table says why the first row has no numbers (its cells were left empty, like a task not asked for)
    assert table[0]["errors"].startswith("valid_loss: cannot load") and "step_00000010" in table[0]["errors"]
    assert table[0]["valid_loss/loss"] == "" and table[1]["errors"] == "" and table[1]["valid_loss/loss"] != ""
    (run_dir / "exports" / "step_00000030" / "config.json").write_text('{"step": 30,')
    with pytest.raises(ValueError, match="step_00000030/config.json: not valid JSON"):
        sw.find_snapshots([str(run_dir)])
    with pytest.raises(ValueError, match="--device 'gpu': not a device"):
        sw.load_model(rows[1], sw.SweepConfig(runs=[], device="gpu"), ["valid_loss"])


# arXiv 2406.16690, Table 4: BoolQ acc, PIQA acc, HellaSwag acc_norm, WinoGrande acc, ARC-e acc, ARC-c acc_norm,
# OBQA acc_norm, and the printed "CSR avg", for every architecture and size
PAPER_TABLE4 = """
llama 0.07 46.48 58.87 27.82 48.46 39.98 21.42 25.60 38.38
tnl 0.07 43.18 58.87 27.77 50.12 39.77 21.76 23.80 37.90
hgrn2 0.07 56.57 59.19 28.05 52.01 38.64 22.61 26.00 40.44
cos2 0.07 47.61 60.94 28.12 49.72 37.33 22.18 23.60 38.50
llama 0.16 52.94 63.66 30.67 51.78 44.32 23.29 26.60 41.89
tnl 0.16 53.82 63.82 31.22 50.20 45.92 23.21 28.80 42.43
hgrn2 0.16 54.01 63.06 31.04 52.41 45.08 23.38 27.00 42.28
cos2 0.16 45.47 63.28 29.72 52.41 44.49 22.53 27.20 40.73
llama 0.41 54.04 67.19 38.75 52.17 49.24 23.72 30.00 45.02
tnl 0.41 60.31 66.65 38.98 51.70 52.61 25.17 30.00 46.49
hgrn2 0.41 60.86 67.74 40.32 51.78 54.21 24.83 31.20 47.28
cos2 0.41 57.40 66.27 36.65 50.59 51.81 23.72 29.00 45.06
llama 1 56.42 69.97 47.04 52.72 57.07 28.16 32.60 49.14
tnl 1 59.85 71.49 48.70 52.57 57.07 27.73 33.20 50.09
hgrn2 1 59.17 71.65 49.52 54.38 60.27 28.07 33.40 50.92
cos2 1 44.28 70.73 45.55 50.51 55.22 27.30 31.00 46.37
llama 3 61.31 73.18 57.88 59.59 63.93 31.40 34.00 54.47
tnl 3 56.76 75.03 60.87 61.33 65.49 33.02 36.40 55.56
hgrn2 3 55.47 74.10 61.48 58.64 65.61 34.47 35.60 55.06
cos2 3 50.92 74.27 57.38 57.30 63.22 31.40 35.20 52.81
llama 7 57.46 75.19 64.39 61.88 67.55 35.41 35.00 56.70
tnl 7 62.63 76.22 66.29 61.48 67.76 38.23 37.80 58.63
hgrn2 7 62.69 76.50 66.96 61.40 69.02 36.86 38.00 58.78
cos2 7 65.02 76.33 63.93 59.19 66.96 36.43 37.60 57.92
"""


def test_csr_average_reproduces_the_papers_printed_averages():
    tasks = ("boolq", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa")
    assert set(tasks) == set(sw.CSR_AVG_TASKS) and "siqa" in sw.CSR_TASKS and "siqa" not in sw.CSR_AVG_TASKS
    rows = [line.split() for line in PAPER_TABLE4.strip().splitlines()]
    assert len(rows) == 24
    for arch, size, *vals in rows:
        scores = dict(zip(tasks, map(float, vals[:7])))
        printed = float(vals[7])
        # the inputs are printed to 0.01, so their mean is known to +-0.005, and the average is rounded too
        assert sw.csr_average(scores) == pytest.approx(printed, abs=0.01), (arch, size)
        assert sw.csr_average({**scores, "siqa": 99.0}) == sw.csr_average(scores)   # SIQA is not averaged
    assert sw.csr_average({t: 50.0 for t in tasks[:-1]}) is None                   # incomplete: no average


def test_csr_average_in_the_table_leaves_siqa_out():
    results = {t: {"acc": 0.5, "acc_norm": 0.6, "paper": v}
               for t, v in zip(sw.CSR_TASKS, (0.1, 0.2, 0.9, 0.3, 0.4, 0.5, 0.6, 0.7))}
    flat = sw.flat_metrics({"results": results})
    assert flat["csr/avg"] == pytest.approx((0.1 + 0.2 + 0.3 + 0.4 + 0.5 + 0.6 + 0.7) / 7)
    assert flat["siqa/paper"] == 0.9


def test_scoring_window_is_the_training_context(tmp_path, monkeypatch, capsys):
    """Perplexity is scored in windows of the context the model was trained at (recorded with the export or
    in its run's config.json), not in windows of the config's max_seq_len (8192 for every model here)."""
    from checkpoints.export import Source, export_config
    from evaluation.context import scoring_window, training_context
    torch.manual_seed(0)
    run = tmp_path / "tnl-tiny-ctx"
    export = run / "exports" / "step_00000010"
    save_pretrained(build_model("tnl", "tiny"), export, extra={"step": 10, "tokens": 1000, "flops": 1e9})
    assert json.loads((export / "config.json").read_text())["model"]["max_seq_len"] == 8192
    assert training_context(export) is None
    (run / "config.json").write_text(json.dumps({"train": {"seq_len": 24}}))
    assert training_context(export) == 24                          # from the run beside it
    # what the exporter records: the run's training context, read from the snapshot's run
    meta = {"model": build_model("tnl", "tiny").config.to_dict(), "step": 10, "tokens": 1000, "flops": 1e9}
    (run / "snapshots" / "step_00000010").mkdir(parents=True)
    extra = export_config(meta, Source(10, "snapshot", run / "snapshots" / "step_00000010"), "fp32")
    assert extra["train_seq_len"] == 24
    extra = export_config({**meta, "config": {"train": {"seq_len": 40}}}, Source(10, "checkpoint", run / "x" / "y"), "fp32")
    assert extra["train_seq_len"] == 40                            # a resume checkpoint carries its run config
    lone = tmp_path / "elsewhere" / "model"
    save_pretrained(build_model("tnl", "tiny"), lone, extra={"train_seq_len": 32, "step": 1, "tokens": 1, "flops": 1.0})
    assert training_context(lone) == 32                            # written into the export itself
    warned = []
    assert scoring_window(tmp_path / "nothing", 8192, warn=warned.append) == 8192 and "not recorded" in warned[0]
    assert scoring_window(export, 8192, override=100) == 100

    seen = []

    def fake_wikitext(model, max_length=None, **kw):
        seen.append(max_length)
        return {"word_perplexity": 10.0}

    monkeypatch.setattr("evaluation.perplexity.wikitext_perplexity", fake_wikitext)
    wiki = tmp_path / "shared" / "eval" / "wikitext-2-raw" / "wiki.test.raw"   # the sweep checks it exists
    wiki.parent.mkdir(parents=True)
    wiki.write_text(" \n = Page = \n \n text . \n")
    monkeypatch.setenv("LINSCALE_SHARED_DATA", str(tmp_path / "shared"))
    rows = sw.sweep(sw.SweepConfig(runs=[str(run)], tasks=["wikitext2"], out=str(tmp_path / "out"), device="cpu"))
    assert seen == [24] and rows[0]["results"]["wikitext2"]["window"] == 24
    sw.sweep(sw.SweepConfig(runs=[str(run)], tasks=["wikitext2"], out=str(tmp_path / "out"), device="cpu",
                            max_length=16))                         # a different window is a different result
    assert seen == [24, 16]
    # the lm-eval model defaults to the same window when given the export directory
    from evaluation.lm_eval_adapter import LinscaleLM
    assert LinscaleLM(pretrained=str(export), device="cpu").max_length == 24


def test_plot_styles_colour_by_architecture_shade_by_size():
    """Sweep plots: legend sorted by architecture then size, sizes as people write them, one hue per architecture
    with darker shades for larger sizes and a marker per size; C is the paper's (no embedding FLOPs) only when
    every snapshot records it, and the axis says which."""
    import colorsys

    from scaling.plots import arch_color
    rows = [{"run": r, "arch": a, "n_params": n} for r, a, n in
            (("t3", "tnl", 2.8e9), ("l70", "llama", 2.1e7), ("t70", "tnl", 2.1e7), ("l1b", "llama", 9.2e8),
             ("t410", "tnl", 3.3e8))]
    st = sw.run_styles(rows)
    assert list(st) == ["l70", "l1b", "t70", "t410", "t3"]
    assert st["t3"]["label"] == "TNL 2.8B (t3)" and st["l70"]["label"] == "LLaMA 21M (l70)"
    assert st["l1b"]["label"] == "LLaMA 920M (l1b)"

    def hue_lum(rgb):
        h, l, _ = colorsys.rgb_to_hls(*rgb)
        return h, l

    for arch, runs in (("llama", ["l70", "l1b"]), ("tnl", ["t70", "t410", "t3"])):
        base = hue_lum(tuple(int(arch_color(arch)[i:i + 2], 16) / 255 for i in (1, 3, 5)))[0]
        hl = [hue_lum(st[r]["color"]) for r in runs]
        assert all(abs(h - base) < 0.02 for h, _ in hl)                      # the architecture's hue
        assert all(a[1] > b[1] for a, b in zip(hl, hl[1:]))                   # larger = darker
        assert len({st[r]["marker"] for r in runs}) == len(runs)
    assert abs(hue_lum(st["l70"]["color"])[0] - hue_lum(st["t70"]["color"])[0]) > 0.1
    full = [{**r, "flops": 1e18, "flops_non_embedding": 8e17} for r in rows]
    assert sw.compute_axis(full)[0] == "flops_non_embedding" and "without the embedding" in sw.compute_axis(full)[1]
    full[0]["flops_non_embedding"] = None
    assert sw.compute_axis(full)[0] == "flops" and "including the embedding" in sw.compute_axis(full)[1]


def test_a_shard_matched_twice_is_read_once(run_dir, tmp_path):
    """--valid-shards given a file twice (a glob and the file, or two spellings of it) reads it once: its tokens
    weighed twice in the mean before. An empty shard holds no window and is passed over; a file of a size that
    is not whole uint32 tokens is named."""
    from evaluation.perplexity import token_windows, validation_loss
    from models import load_pretrained
    f = tmp_path / "val.bin"
    np.random.default_rng(2).integers(0, 100277, 3 * 17 + 5, dtype=np.uint32).tofile(f)
    (tmp_path / "val_empty.bin").write_bytes(b"")
    export = run_dir / "exports" / "step_00000010"
    cfg = sw.SweepConfig(runs=[str(export)], tasks=["valid_loss"], valid_seq_len=16, device="cpu", batch_size=2,
                         valid_shards=[str(f), str(tmp_path / "val*.bin"), str(tmp_path / "." / "val.bin")],
                         out=str(tmp_path / "out"), plots=False)
    got = sw.sweep(cfg)[0]["results"]["valid_loss"]
    ref = validation_loss(load_pretrained(export), token_windows([f], 17), 2)  # the file once, by hand
    assert got["windows"] == ref["windows"] == 3 and got["tokens"] == 48
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-9)
    (tmp_path / "val_cut.bin").write_bytes(b"\0" * 10)
    cfg.force = True
    with pytest.raises(ValueError, match=r"val_cut.bin: 10 bytes, not a whole number of uint32 tokens"):
        sw.sweep(cfg)


def _lambada(path, texts):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))


def test_cache_follows_the_evaluation_data(run_dir, tmp_path, monkeypatch):
    """The cached LAMBADA result is redone when the data it was computed on changes ($LINSCALE_SHARED_DATA at
    another copy, a repaired file): it was reused before, so a fixed data folder kept reporting the old numbers.
    A result cached before the data was in the key is kept; a damaged cache entry is a miss, not a crash."""
    from evaluation.perplexity import lambada_openai
    from models import load_pretrained
    data = tmp_path / "shared"
    lam = data / "eval" / "lambada" / "lambada_test.jsonl"
    _lambada(lam, ["the cat sat on the mat", "a b c d"])
    monkeypatch.setenv("LINSCALE_SHARED_DATA", str(data))
    calls = []
    real = sw.run_tasks
    monkeypatch.setattr(sw, "run_tasks", lambda tasks, *a: calls.append(tasks) or real(tasks, *a))
    export = run_dir / "exports" / "step_00000010"
    cfg = sw.SweepConfig(runs=[str(export)], tasks=["lambada_openai"], device="cpu", out=str(tmp_path / "out"),
                         plots=False)
    sw.sweep(cfg)
    sw.sweep(cfg)
    assert len(calls) == 1
    _lambada(lam, ["one two three four five", "x y z", "hello there world"])   # the data repaired
    got = sw.sweep(cfg)[0]["results"]["lambada_openai"]
    assert len(calls) == 2
    ref = lambada_openai(load_pretrained(export), lam, max_length=32)
    assert got["examples"] == 3 and got["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-9)
    # the same content copied elsewhere is the same data: cached
    other = tmp_path / "copy"
    _lambada(other / "eval" / "lambada" / "lambada_test.jsonl", ["one two three four five", "x y z", "hello there world"])
    monkeypatch.setenv("LINSCALE_SHARED_DATA", str(other))
    sw.sweep(cfg)
    assert len(calls) == 2
    entry = tmp_path / "out" / "cache" / "run_a" / "step_00000010" / "lambada_openai.json"
    rec = json.loads(entry.read_text())
    del rec["key"]["settings"]["data"]           # as written before the data was part of the key
    entry.write_text(json.dumps(rec))
    sw.sweep(cfg)
    assert len(calls) == 2
    entry.write_text(entry.read_text()[:40])     # cut short
    assert sw.sweep(cfg)[0]["results"]["lambada_openai"]["examples"] == 3
    assert len(calls) == 3


def test_out_that_is_a_file_is_refused_before_any_model(run_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(sw, "load_model", lambda *a: pytest.fail("a model was loaded"))
    (tmp_path / "taken").write_text("x")
    cfg = sw.SweepConfig(runs=[str(run_dir)], tasks=["wikitext2"], device="cpu", out=str(tmp_path / "taken" / "eval"))
    with pytest.raises(NotADirectoryError, match=r"--out .*taken/eval: cannot create the folder .*taken is a file"):
        sw.sweep(cfg)


def test_a_diverged_snapshot_reports_infinite_perplexity(tmp_path, monkeypatch):
    """A snapshot whose losses run into the thousands of nats (a diverged run; here the tied embedding scaled up)
    has a perplexity past the largest float: it is reported as inf, as validation_loss does, and the sweep goes
    on. math.exp raised OverflowError there, which stopped the whole sweep at that snapshot."""
    from data_pipeline.tokenizer import EOT_ID, get_tokenizer
    from evaluation import perplexity
    torch.manual_seed(0)
    model = build_model("tnl", "tiny", max_seq_len=64).eval()
    with torch.no_grad():
        model.embed.weight.mul_(3000)
    text = "the cat sat on the mat and went to sleep on the rug"
    data = tmp_path / "shared"
    _lambada(data / "eval" / "lambada" / "lambada_test.jsonl", [text])
    page = " = Cats = \n \n the cat sat on the mat . \n"
    wiki = tmp_path / "wiki.raw"
    wiki.write_text(" \n" + page)
    tok = get_tokenizer()

    def direct_ll(ctx: list[int], cont: list[int]) -> float:   # one full forward pass, float64 log-softmax
        ids = ctx + cont
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).double(), -1)[0]
        return sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))

    ctx, last = text.rsplit(" ", 1)
    lam_ll = direct_ll(tok.encode_ordinary(ctx), tok.encode_ordinary(" " + last))
    assert -lam_ll > 710                                   # exp(-mean ll) is past the largest float (~1.8e308)
    lam = perplexity.lambada_openai(model, data / "eval" / "lambada" / "lambada_test.jsonl", max_length=64)
    assert lam["perplexity"] == math.inf and lam["examples"] == 1 and lam["acc"] == 0.0
    wiki_ll = direct_ll([EOT_ID], tok.encode_ordinary(perplexity.wikitext_detokenizer(page)))
    # lm-eval's count, re.split(r"\s+", page), by hand: = Cats = the cat sat on the mat . and the empty strings
    # before the leading and after the trailing whitespace
    words, nbytes = 12, len(page.encode())
    assert -wiki_ll / words > 710
    wt = perplexity.wikitext_perplexity(model, wiki, max_length=64)
    assert (wt["words"], wt["bytes"]) == (words, nbytes)
    assert wt["word_perplexity"] == math.inf and wt["byte_perplexity"] == math.inf
    assert wt["bits_per_byte"] == pytest.approx(-wiki_ll / nbytes / math.log(2), rel=1e-4)   # finite: still reported
    # in the sweep: the diverged snapshot is a row of the table, beside the healthy one
    run = tmp_path / "run"
    save_pretrained(model, run / "exports" / "step_00000010", extra={"step": 10, "tokens": 1000, "flops": 1e10})
    torch.manual_seed(0)
    save_pretrained(build_model("tnl", "tiny", max_seq_len=64), run / "exports" / "step_00000020",
                    extra={"step": 20, "tokens": 2000, "flops": 2e10})
    monkeypatch.setenv("LINSCALE_SHARED_DATA", str(data))
    rows = sw.sweep(sw.SweepConfig(runs=[str(run)], tasks=["lambada_openai"], device="cpu", out=str(tmp_path / "out"),
                                   max_length=64))
    assert rows[0]["results"]["lambada_openai"]["perplexity"] == math.inf
    assert math.isfinite(rows[1]["results"]["lambada_openai"]["perplexity"])
    with open(tmp_path / "out" / "results.csv") as fh:
        assert [r["lambada_openai/perplexity"] for r in csv.DictReader(fh)][0] == "inf"


def test_folders_in_exports_that_are_not_exports_are_named(run_dir, monkeypatch):
    """exports/ is written one whole export at a time, so a step folder without its config.json or weights is
    damaged: it is named in a warning (it was left out of the table without a word); one being written (.tmp) is
    not. A config.json without the model section (a Hugging Face folder) is refused with its path (a KeyError
    traceback before)."""
    warned = []
    monkeypatch.setattr(sw.logger, "warning", warned.append)
    (run_dir / "exports" / "step_00000020").mkdir()
    (run_dir / "exports" / "step_00000020" / "model.safetensors").write_bytes(b"x")
    (run_dir / "exports" / "step_00000040.tmp").mkdir()
    snaps = sw.find_snapshots([str(run_dir)])
    assert [s["step"] for s in snaps] == [10, 30]
    assert len(warned) == 1 and "step_00000020: not an export (no config.json)" in warned[0]
    assert "--step 20 --force" in warned[0]
    cfg = run_dir / "exports" / "step_00000030" / "config.json"
    cfg.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": 32000}))
    with pytest.raises(ValueError, match=r'step_00000030/config.json: no "model" section'):
        sw.find_snapshots([str(run_dir)])


def test_missing_inputs_are_named_before_any_model(run_dir, tmp_path, monkeypatch):
    """A missing evaluation file, --niah-haystack file, or a --valid-shards folder is named before any model is
    loaded (each surfaced only after a model was loaded and earlier tasks had run, the last two as a bare
    errno message); a folder that a --valid-shards glob also matches is passed over, not read as tokens."""
    monkeypatch.setattr(sw, "load_model", lambda *a: pytest.fail("a model was loaded"))
    monkeypatch.setenv("LINSCALE_SHARED_DATA", str(tmp_path / "no_data"))
    base = dict(runs=[str(run_dir)], device="cpu", out=str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError, match=r"boolq: .*no_data/eval/boolq/val.jsonl not found"):
        sw.sweep(sw.SweepConfig(tasks=["boolq"], **base))
    with pytest.raises(FileNotFoundError, match=r"no_data/eval/wikitext-2-raw/wiki.test.raw not found"):
        sw.sweep(sw.SweepConfig(tasks=["wikitext2"], **base))
    with pytest.raises(FileNotFoundError, match=r"--niah-haystack .*nothing.txt: no such file"):
        sw.sweep(sw.SweepConfig(tasks=["niah_easy"], niah_lengths=[256], niah_haystack=[str(tmp_path / "nothing.txt")],
                                **base))
    with pytest.raises(FileNotFoundError, match=r"no haystack text under .*no_data/train/en/gutenberg"):
        sw.sweep(sw.SweepConfig(tasks=["niah_easy"], niah_lengths=[256], **base))
    shards = tmp_path / "val"
    (shards / "old").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"val is a folder but not a prepared dataset .*give the token files in it"):
        sw.sweep(sw.SweepConfig(tasks=["valid_loss"], valid_shards=[str(shards)], **base))
    monkeypatch.undo()
    np.random.default_rng(0).integers(0, 100277, 2 * 17, dtype=np.uint32).tofile(shards / "a.bin")
    rows = sw.sweep(sw.SweepConfig(tasks=["valid_loss"], valid_shards=[str(shards / "*")], valid_seq_len=16,
                                   plots=False, **{**base, "runs": [str(run_dir / "exports" / "step_00000010")]}))
    assert rows[0]["results"]["valid_loss"]["windows"] == 2 and rows[0]["results"]["valid_loss"]["tokens"] == 32


def test_the_haystack_in_another_order_is_another_cached_result(tmp_path):
    """The haystack is its files' text laid end to end in the order given; the same files in another order
    are another haystack (other text at every depth), so a NIAH result cached for one order is not reused
    for the other."""
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("The first book speaks of rivers and hills. " * 20)
    b.write_text("A second volume concerns ships, tides and harbours. " * 20)
    from evaluation import niah
    assert niah.haystack_tokens([a, b], 50) != niah.haystack_tokens([b, a], 50)

    def settings(files):
        cfg = sw.SweepConfig(runs=["unused"], tasks=["niah_standard"], niah_haystack=[str(f) for f in files],
                             device="cpu")
        return sw.task_settings("niah_standard", cfg, window=64, dtype="float32")

    assert settings([a, b]) == settings([a, b])
    assert settings([a, b]) != settings([b, a])


def test_an_installed_copy_finds_the_shared_data_beside_the_working_checkout(tmp_path, monkeypatch):
    """`pip install .` puts a copy of evaluation/ into site-packages, which the plain `lm_eval` command
    imports: without $LINSCALE_SHARED_DATA it finds shared/data beside the checkout the command runs in
    (from any folder inside it), not beside site-packages."""
    from evaluation import local_data
    site = tmp_path / "venv" / "lib" / "site-packages"
    checkout = tmp_path / "work" / "linscale"
    (checkout / "evaluation").mkdir(parents=True)
    (checkout / "evaluation" / "local_data.py").write_text("")
    (checkout / "docs").mkdir()
    shared = tmp_path / "work" / "shared" / "data"
    shared.mkdir(parents=True)
    monkeypatch.delenv("LINSCALE_SHARED_DATA", raising=False)
    monkeypatch.setattr(local_data, "REPO_ROOT", site)
    for where in (checkout, checkout / "docs"):
        monkeypatch.chdir(where)
        assert local_data.shared_data_dir() == shared
    monkeypatch.chdir(tmp_path)      # outside any checkout: the installed location, which the error names
    assert local_data.shared_data_dir() == site.parent / "shared" / "data"
    monkeypatch.setenv("LINSCALE_SHARED_DATA", str(tmp_path / "elsewhere"))
    assert local_data.shared_data_dir() == tmp_path / "elsewhere"


def test_valid_loss_of_a_prepared_dataset_is_the_trainers_val_loss(tmp_path):
    """`--valid-shards DATASET` (a folder of launch/prepare_data.py, or its val/ split) evaluates an export on
    the val split as the trainer's validation reads it: on the export of the last step it gives the val_loss
    the trainer logged there (the same windows, the same weights, fp32 on the CPU). A folder that is no
    prepared dataset is refused, naming both forms."""
    from checkpoint_utils import make_dataset, run_flags, run_pretrain
    from checkpoints.export import export_run
    data = make_dataset(tmp_path / "data")
    run = tmp_path / "run"
    run_pretrain(run_flags(run, data, 3, "--eval-every", "3", "--eval-batches", "2", "--save-every", "3"))
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val_loss = [r["val_loss"] for r in logged if r.get("step") == 3 and "val_loss" in r][0]
    export_run(run, 3, log=lambda m: None)
    for given in (data, data / "val"):
        cfg = sw.SweepConfig(runs=[str(run)], tasks=["valid_loss"], valid_shards=[str(given)], valid_seq_len=16,
                             valid_windows=2 * 8, out=str(tmp_path / f"out-{given.name}"), device="cpu", batch_size=4)
        got = sw.sweep(cfg)[0]["results"]["valid_loss"]
        assert got["windows"] == 16 and got["loss"] == pytest.approx(val_loss, rel=1e-5), (got, val_loss)
    (tmp_path / "plain").mkdir()
    cfg = sw.SweepConfig(runs=[str(run)], tasks=["valid_loss"], valid_shards=[str(tmp_path / "plain")],
                         out=str(tmp_path / "out-plain"), device="cpu")
    with pytest.raises(ValueError, match="not a prepared dataset .*token files in it"):
        sw.sweep(cfg)


def test_valid_loss_keeps_its_cached_result_when_other_tasks_settings_change(tmp_path):
    """valid_loss scores valid_windows windows of valid_seq_len: --limit and the other tasks' scoring window
    do not touch it, so its cache key leaves them out (a --limit added for a quick CSR pass recomputed it);
    its own settings still make another result, and wikitext2 still keys on --limit."""
    shard = tmp_path / "val.bin"
    shard.write_bytes(b"\0" * 4096)

    def settings(task="valid_loss", window=64, **kw):
        cfg = sw.SweepConfig(runs=["unused"], tasks=[task], valid_shards=[str(shard)], device="cpu", **kw)
        return sw.task_settings(task, cfg, window=window, dtype="float32")

    assert settings() == settings(limit=4) == settings(window=128)
    assert settings() != settings(valid_windows=3) and settings() != settings(valid_seq_len=64)
    assert settings("wikitext2") != settings("wikitext2", limit=4)


def test_commonsense_results_count_the_items_whose_context_was_cut(tmp_path):
    """A commonsense task in a window shorter than some items: each item's context is cut from the left (its
    choices scored whole), the task's `truncated` says how many items, and acc is the argmax of choice
    log-likelihoods computed by hand on the cut windows; in a window that holds every item nothing is cut and
    acc is that of the whole contexts. (A task of the sweep's name, `piqa_local`, from a folder of our own.)"""
    from lm_eval.tasks import TaskManager

    from eval_utils import write_tiny_mc_task
    from evaluation.perplexity import encode_pair
    torch.manual_seed(3)
    model = build_model("hgrn2", "tiny", max_seq_len=64).eval()
    long_q = "In the old harbour town, after the long winter and the storms that closed the roads, the sky was"
    rows = [{"q": "The sky is", "choices": [" blue", " loud"], "label": 0},
            {"q": long_q, "choices": [" blue again", " a colour nobody had seen"], "label": 1},
            {"q": "Fire is", "choices": [" hot", " cold"], "label": 0},
            {"q": long_q + " " + long_q, "choices": [" grey", " green"], "label": 1}]
    write_tiny_mc_task(tmp_path, "piqa_local", rows)

    def hand_acc(window: int) -> tuple[float, int]:
        hits, cut = 0, 0
        for r in rows:
            lls = []
            for c in r["choices"]:
                ce, ke = encode_pair(r["q"], c)
                ids = (ce + ke)[-(window + 1):]
                with torch.no_grad():
                    logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).double(), -1)[0]
                lls.append(sum(float(logp[len(ids) - 1 - len(ke) + i, t]) for i, t in enumerate(ke)))
            cut += any(len(sum(encode_pair(r["q"], c), [])) > window + 1 for c in r["choices"])
            hits += int(max(range(len(lls)), key=lls.__getitem__) == r["label"])
        return hits / len(rows), cut

    for window in (12, 64):
        acc, cut = hand_acc(window)
        assert (cut > 0) == (window == 12)
        tm = TaskManager(include_path=str(tmp_path), include_defaults=False)
        res = sw.run_lm_eval(model, ["piqa"], sw.SweepConfig(runs=[], batch_size=3), window=window, task_manager=tm)
        assert res["piqa"]["truncated"] == cut
        assert res["piqa"]["acc"] == pytest.approx(acc) and res["piqa"]["paper"] == res["piqa"]["acc"]
    assert hand_acc(12)[1] == 2                                      # items 1 and 3, by hand
    with pytest.raises(ValueError, match=r"task piqa_local, item 1: a continuation of \d+ tokens .* Pass --max-length"):
        sw.run_lm_eval(model, ["piqa"], sw.SweepConfig(runs=[], batch_size=3), window=3,
                       task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))


def test_piqa_needs_a_window_as_long_as_its_longest_solution(shared_data, monkeypatch):
    """PIQA validation item 314 has a solution of 234 tokens (the longest continuation of the eight commonsense
    tasks): in windows below 234 tokens (the tiny preset trains at 128) it cannot be scored whole, and the
    error names the task, the item and the window; 234 holds every PIQA request."""
    from evaluation.request_replay import build_requests
    from evaluation.scoring import check_requests_fit, truncated_requests
    monkeypatch.setenv("LINSCALE_SHARED_DATA", str(shared_data))
    req = build_requests(["piqa"], None)
    pairs, labels = [tuple(p) for p in req["pairs"]], req["items"]
    assert max(len(k) for _, k in pairs) == 234
    with pytest.raises(ValueError, match=r"^task piqa_local, item 314: a continuation of 234 tokens is longer than the "
                                         r"scoring window max_length 128.* Pass --max-length 234 or more"):
        check_requests_fit(pairs, 128, labels)
    with pytest.raises(ValueError, match="item 314: a continuation of 234 tokens"):
        check_requests_fit(pairs, 233, labels)
    check_requests_fit(pairs, 234, labels)
    # the contexts cut in that window: every request longer than 235 tokens, counted by hand
    assert truncated_requests(pairs, 234) == [i for i, (c, k) in enumerate(pairs) if len(c) + len(k) > 235]


def test_a_snapshot_whose_config_is_cut_short_is_reported_and_the_others_evaluated(run_dir, tmp_path, monkeypatch):
    """One export of a run with its config.json cut short: a warning names the file and the command that exports
    the step again, its row of the table carries that error, and the other snapshots are evaluated (the sweep
    refused to start at all before). Given alone to find_snapshots it is still an error."""
    shards = tmp_path / "val.bin"
    np.random.default_rng(0).integers(0, 100277, 3 * 17, dtype=np.uint32).tofile(shards)
    bad = run_dir / "exports" / "step_00000010" / "config.json"
    bad.write_text(bad.read_text()[:40])
    warned = []
    monkeypatch.setattr(sw.logger, "warning", warned.append)
    rows = sw.sweep(sw.SweepConfig(runs=[str(run_dir)], tasks=["valid_loss"], valid_shards=[str(shards)],
                                   valid_seq_len=16, out=str(tmp_path / "out"), device="cpu", plots=False))
    assert [r["snapshot"] for r in rows] == ["step_00000010", "step_00000030"]
    assert "not valid JSON" in rows[0]["results"]["valid_loss"]["error"]
    assert rows[1]["results"]["valid_loss"]["windows"] == 3
    assert any(f"{bad}: not valid JSON" in w and f"launch/export.py {run_dir.resolve()} --step 10 --force" in w
               for w in warned), warned
    with open(tmp_path / "out" / "results.csv") as fh:
        table = list(csv.DictReader(fh))
    assert table[0]["step"] == "10" and "config.json: not valid JSON" in table[0]["errors"]
    assert table[1]["errors"] == "" and table[1]["valid_loss/loss"] != ""
    with pytest.raises(ValueError, match="step_00000010/config.json: not valid JSON"):
        sw.find_snapshots([str(run_dir)])


def test_niah_grids_that_cannot_run_are_named_before_any_model(run_dir, tmp_path, monkeypatch):
    """An empty depth (or length) grid, and context lengths too short for the needle and the question, are one
    error naming the flag and the fix, before any model is loaded (the short length ended the task only after the
    model was loaded; the empty grid said only 'NIAH depths: empty')."""
    from data_pipeline.tokenizer import get_tokenizer
    from evaluation import niah
    monkeypatch.setattr(sw, "load_model", lambda *a: pytest.fail("a model was loaded"))
    hay = tmp_path / "hay.txt"
    hay.write_text("grass " * 400)
    base = dict(runs=[str(run_dir)], device="cpu", out=str(tmp_path / "out"), niah_haystack=[str(hay)])
    with pytest.raises(ValueError, match=r"NIAH depths: the grid is empty.*--niah-depths 0 50 100"):
        sw.sweep(sw.SweepConfig(tasks=["niah_easy"], niah_depths=[], niah_lengths=[256], **base))
    with pytest.raises(ValueError, match=r"NIAH lengths: the grid is empty.*--niah-lengths"):
        sw.sweep(sw.SweepConfig(tasks=["niah_standard"], niah_depths=[50], niah_lengths=[], **base))
    # the longest needle + question of the standard grid below, counted by hand
    cfg = niah.NiahConfig(mode="standard", lengths=(16, 256), depths=(0.0, 100.0))
    tok = get_tokenizer()
    need = max(1 + len(tok.encode_ordinary(f" The special magic number for {n.key} is {n.value}."))
               + len(tok.encode_ordinary(f"\n\nWhat is the special magic number for {n.key}? The special magic "
                                         f"number for {n.key} is"))
               for n in niah.draw_needles(cfg).values())
    assert 16 < need < 256
    with pytest.raises(ValueError, match=rf"NIAH standard: context length 16 too short .*give --niah-lengths of at "
                                         rf"least {need}"):
        sw.sweep(sw.SweepConfig(tasks=["niah_standard"], niah_depths=[0, 100], niah_lengths=[16, 256], **base))
    niah.check_lengths(niah.NiahConfig(mode="standard", lengths=(need, 256), depths=(0.0, 100.0)))
