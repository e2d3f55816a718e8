"""Reading runs for the scaling fits: compute from the config, units, and logs that are messy in every way the
trainer's can be (different intervals, missing rows, NaN losses, a resumed run re-logging, a truncated line)."""
import json
import math
from pathlib import Path

import numpy as np
import pytest

from models.accounting import flops_per_step
from models.sizes import model_config
from scaling.envelope import loss_at, smooth_loss
from scaling.runs import RunError, find_run_dirs, load_run, load_runs, select_seq_len, size_label
from scaling.synthetic import LossLaw, write_run
from scaling.units import PFLOP_DAY, coef_pflop_days_to_flops, flops_to_pflop_days, pflop_days_to_flops


def _write(path: Path, cfg, rows_text: str, seq_len: int = 64, batch: int = 4) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model": cfg.to_dict(),
                                                  "train": {"seq_len": seq_len, "global_batch": batch}}))
    (path / "metrics.jsonl").write_text(rows_text)
    return path


def test_pflop_day_is_1e15_flops_for_a_day():
    assert PFLOP_DAY == 1e15 * 24 * 3600
    assert flops_to_pflop_days(3 * 8.64e19) == pytest.approx(3.0)
    assert pflop_days_to_flops(flops_to_pflop_days(1.234e21)) == pytest.approx(1.234e21)


def test_coefficient_in_flops_predicts_the_same_loss():
    beta, alpha = 3.5391, -0.0768
    beta_flops = coef_pflop_days_to_flops(beta, alpha)
    c_flops = 2.5e21
    assert beta_flops * c_flops ** alpha == pytest.approx(beta * (c_flops / 8.64e19) ** alpha, rel=1e-12)


@pytest.mark.parametrize("arch", ["llama", "tnl", "hgrn2", "cos2"])
def test_compute_is_steps_times_the_paper_flops_per_step(tmp_path, arch):
    cfg = model_config(arch, "tiny")
    seq_len, batch = 64, 4
    rows = "".join(json.dumps({"step": s, "tokens": s * seq_len * batch, "loss": 5.0}) + "\n" for s in (1, 2, 10))
    run_dir = _write(tmp_path / arch, cfg, rows, seq_len, batch)
    for emb in (True, False):
        run = load_run(run_dir, include_embedding=emb)
        expect = np.array([1, 2, 10]) * flops_per_step(cfg, batch, seq_len, include_embedding=emb)
        # rtol: HGRN2's 12*d*l term is per step in the paper, per sequence here (1.2e-5 of this tiny step)
        np.testing.assert_allclose(run.compute, expect, rtol=2e-5)
    # the embedding term is 12*b*n*d*v per step, i.e. 12*d*v per token
    diff = load_run(run_dir, True).compute - load_run(run_dir, False).compute
    np.testing.assert_allclose(diff, 12 * cfg.d_model * cfg.vocab_size * np.array([1, 2, 10]) * seq_len * batch,
                               rtol=1e-9)


def test_bad_rows_are_skipped_and_counted(tmp_path):
    cfg = model_config("tnl", "tiny")
    good = [json.dumps({"step": s, "tokens": 256 * s, "loss": 10.0 / s}) for s in range(1, 6)]
    lines = [
        good[0],
        json.dumps({"step": 2, "tokens": 512, "loss": float("nan")}),  # written by json.dumps as NaN
        json.dumps({"step": 3, "tokens": 768}),                          # no loss
        json.dumps({"step": 4, "tokens": 1024, "loss": "oops"}),         # loss not a number
        "",                                                              # blank lines are not rows
        "[1, 2, 3]",                                                     # not an object
        json.dumps({"step": 5, "loss": 2.0}),                            # no tokens
        good[4],
        json.dumps({"step": 6, "tokens": 1536, "loss": float("inf")}),   # written as Infinity
        good[4][: len(good[4]) // 2],                                    # truncated last line (crash mid-write)
    ]
    run = load_run(_write(tmp_path / "r", cfg, "\n".join(lines)))
    np.testing.assert_array_equal(run.tokens, [256, 1280])
    np.testing.assert_allclose(run.loss, [10.0, 2.0])
    assert run.skipped == {"loss missing or not finite": 4, "not a JSON object": 1, "no tokens": 1,
                           "unparseable line (e.g. truncated)": 1}
    assert run.n_skipped == 7


def test_resumed_run_keeps_the_later_log_of_each_step(tmp_path):
    cfg = model_config("hgrn2", "tiny")
    first = [{"step": s, "tokens": 100 * s, "loss": 9.0 - 0.1 * s} for s in range(1, 11)]
    # crash after step 10, resume from the checkpoint at step 6: steps 6.. are logged again
    second = [{"step": s, "tokens": 100 * s, "loss": 5.0 - 0.1 * s} for s in range(6, 13)]
    run = load_run(_write(tmp_path / "r", cfg, "".join(json.dumps(r) + "\n" for r in first + second)))
    np.testing.assert_array_equal(run.tokens, 100 * np.arange(1, 13))
    np.testing.assert_allclose(run.loss[:5], 9.0 - 0.1 * np.arange(1, 6))
    np.testing.assert_allclose(run.loss[5:], 5.0 - 0.1 * np.arange(6, 13))
    assert run.skipped == {"superseded by a later log of the same step (resume)": 5}


def test_skip_tokens_drops_early_rows(tmp_path):
    cfg = model_config("tnl", "tiny")
    rows = "".join(json.dumps({"step": s, "tokens": 100 * s, "loss": 3.0}) + "\n" for s in range(1, 11))
    run = load_run(_write(tmp_path / "r", cfg, rows), min_tokens=450)
    np.testing.assert_array_equal(run.tokens, [500, 600, 700, 800, 900, 1000])
    assert run.skipped == {"below --skip-tokens": 4}


def test_the_warmup_is_skipped_on_request(tmp_path):
    """Rows up to optim.warmup_steps x tokens per step (from the run's own config) are left out when asked."""
    cfg = model_config("tnl", "tiny")
    seq_len, batch = 64, 4
    rows = "".join(json.dumps({"step": s, "tokens": s * seq_len * batch, "loss": 3.0}) + "\n" for s in range(1, 11))
    d = _write(tmp_path / "r", cfg, rows, seq_len, batch)
    config = json.loads((d / "config.json").read_text())
    config["optim"] = {"warmup_steps": 3}
    (d / "config.json").write_text(json.dumps(config))
    run = load_run(d, skip_warmup=True)
    assert run.warmup_tokens == 3 * seq_len * batch
    np.testing.assert_array_equal(run.tokens, np.arange(4, 11) * seq_len * batch)
    assert run.skipped == {"in the lr warm-up (--skip-warmup)": 3}
    assert len(load_run(d).tokens) == 10
    # a config written by the trainer carries global_batch_tokens instead; the log's own tokens per step
    # win over it: under --allow-inexact-batch the trainer ran another batch than config.json asks for
    config["train"] = {"seq_len": seq_len, "global_batch_tokens": 2 * seq_len * batch}
    (d / "config.json").write_text(json.dumps(config))
    assert load_run(d).warmup_tokens == 3 * seq_len * batch
    run = load_run(d, skip_warmup=True)
    np.testing.assert_array_equal(run.tokens, np.arange(4, 11) * seq_len * batch)
    # a log without step numbers: the config's batch is all there is
    (d / "metrics.jsonl").write_text("".join(json.dumps({"tokens": s * seq_len * batch, "loss": 3.0}) + "\n"
                                             for s in range(1, 11)))
    assert load_run(d).warmup_tokens == 6 * seq_len * batch


def test_the_warmup_of_an_inexact_batch_ends_at_its_logged_step(tmp_path):
    """480 sequences asked for, 512 trained (--allow-inexact-batch): the warm-up's 5 steps end at 5 x 512
    sequences of tokens, as the log counts them, not at 5 x 480 (which would keep step 5's row)."""
    cfg = model_config("tnl", "tiny")
    seq_len = 16
    rows = "".join(json.dumps({"step": s, "tokens": s * 512 * seq_len, "loss": 3.0}) + "\n" for s in range(1, 9))
    d = _write(tmp_path / "r", cfg, rows, seq_len, 480)
    config = json.loads((d / "config.json").read_text())
    config["optim"] = {"warmup_steps": 5}
    config["train"] = {"seq_len": seq_len, "global_batch_tokens": 480 * seq_len, "allow_inexact_batch": True}
    (d / "config.json").write_text(json.dumps(config))
    run = load_run(d, skip_warmup=True)
    assert run.warmup_tokens == 5 * 512 * seq_len
    np.testing.assert_array_equal(run.tokens, np.arange(6, 9) * 512 * seq_len)


def test_rows_the_trainer_flagged_are_left_out(tmp_path):
    cfg = model_config("hgrn2", "tiny")
    rows = [{"step": s, "tokens": 100 * s, "loss": 3.0} for s in range(1, 8)]
    rows[2]["loss_spike"] = True
    rows[2]["loss"] = 30.0
    rows[4]["skipped"] = True
    rows[5]["skipped"] = False        # only a true flag counts
    run = load_run(_write(tmp_path / "r", cfg, "".join(json.dumps(r) + "\n" for r in rows)))
    np.testing.assert_array_equal(run.tokens, [100, 200, 400, 600, 700])
    assert run.skipped == {"flagged loss_spike by the trainer": 1, "flagged skipped (no update) by the trainer": 1}


def test_default_compute_is_the_papers_without_embedding(tmp_path):
    cfg = model_config("llama", "tiny")
    rows = "".join(json.dumps({"step": s, "tokens": s * 256, "loss": 5.0}) + "\n" for s in (1, 2))
    run = load_run(_write(tmp_path / "r", cfg, rows))
    assert not run.include_embedding
    np.testing.assert_allclose(run.compute, np.array([1, 2]) * flops_per_step(cfg, 4, 64, include_embedding=False))


def test_size_labels_are_human():
    assert [size_label(n) for n in (6_476_500_000, 2_775_800_000, 906_200_000, 85_000_000, 20_500_000, 460_000, 12)] \
        == ["6.5B", "2.8B", "906M", "85M", "20M", "460K", "12"]


def test_sequence_length_variants_of_one_size_are_not_mixed(tmp_path):
    law = LossLaw()
    for size, seq in (("mini", 256), ("70m", 256), ("70m", 1024), ("160m", 256), ("160m", 1024)):
        write_run(tmp_path / f"llama-{size}-{seq}", model_config("llama", size), law, 1e8, seq_len=seq, n_rows=10)
    runs, _ = load_runs([tmp_path])
    kept, warn = select_seq_len(runs)
    assert {r.seq_len for r in kept} == {256} and len(kept) == 3          # the length most sizes have
    assert "variants of one size" in warn[0] and "llama-70m-1024" in warn[0] and "--seq-len" in warn[0]
    kept, warn = select_seq_len(runs, 1024)
    assert sorted(r.name for r in kept) == ["llama-160m-1024", "llama-70m-1024"] and "left out 3" in warn[0]
    # different lengths for different sizes only: kept, with a warning
    kept, warn = select_seq_len([r for r in runs if r.name in ("llama-mini-256", "llama-70m-1024")])
    assert len(kept) == 2 and "different context lengths" in warn[0]
    assert select_seq_len([r for r in runs if r.seq_len == 256]) == ([r for r in runs if r.seq_len == 256], [])


def test_logging_interval_does_not_change_the_loss_at_c(tmp_path):
    cfg, law = model_config("tnl", "mini"), LossLaw()
    dense = load_run(write_run(tmp_path / "dense", cfg, law, 2e8, n_rows=2000))
    sparse = load_run(write_run(tmp_path / "sparse", cfg, law, 2e8, n_rows=37, drop_frac=0.3, nan_every=4, seed=3))
    assert sparse.skipped["loss missing or not finite"] > 0
    c = np.logspace(np.log10(sparse.compute[0]), np.log10(sparse.compute[-1]), 50)
    truth = law(dense.n_params, c / dense.flops_per_token)
    np.testing.assert_allclose(loss_at(dense, c), truth, rtol=2e-4)
    np.testing.assert_allclose(loss_at(sparse, c), truth, rtol=5e-3)
    assert np.isnan(loss_at(sparse, np.array([sparse.compute[0] / 2, sparse.compute[-1] * 2]))).all()


def test_smoothing_is_a_box_filter_in_log_tokens():
    rng = np.random.default_rng(0)
    tokens = np.sort(rng.uniform(1e3, 1e7, 400))
    loss = 3.0 * np.exp(0.05 * rng.standard_normal(400))
    h = 0.1
    got = smooth_loss(tokens, loss, h)
    x = np.log10(tokens)
    naive = np.array([np.exp(np.log(loss[np.abs(x - xi) <= h]).mean()) for xi in x])
    np.testing.assert_allclose(got, naive, rtol=1e-10)
    assert np.std(np.log(got)) < 0.5 * np.std(np.log(loss))
    assert smooth_loss(tokens, loss, 0.0) is loss


def test_missing_files_and_empty_folders_are_clear_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunError, match="no run directories inside"):
        find_run_dirs([tmp_path / "empty"])
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text(json.dumps({"model": model_config("tnl", "tiny").to_dict(),
                                                  "train": {"seq_len": 64}}))
    with pytest.raises(RunError, match="missing metrics.jsonl"):
        load_runs([half])
    with pytest.raises(RunError, match="no such file"):
        find_run_dirs([tmp_path / "nope"])
    with pytest.raises(RunError, match="no runs found"):
        find_run_dirs([])
    good = write_run(tmp_path / "runs" / "tnl-tiny", model_config("tnl", "tiny"), LossLaw(), 1e6, n_rows=10)
    (tmp_path / "runs" / "README.md").write_text("a file among the runs")
    runs, problems = load_runs([good.parent, half, tmp_path / "runs" / "README.md"], skip_bad=True)
    assert [r.name for r in runs] == ["tnl-tiny"] and len(problems) == 2
    assert "metrics.jsonl" in problems[1] and "not a directory" in problems[0]


def test_a_run_given_twice_counts_once_and_a_damaged_child_is_named(tmp_path):
    """One run under two spellings (a folder of runs and the run itself by an absolute path, a symlink) is
    one run; a child of a folder of runs with only one of its two files is an error, not passed over."""
    runs_dir = tmp_path / "runs"
    for size in ("tiny", "mini"):
        write_run(runs_dir / f"tnl-{size}", model_config("tnl", size), LossLaw(), 1e6, n_rows=10)
    (tmp_path / "link").symlink_to(runs_dir / "tnl-mini")
    found = find_run_dirs([runs_dir, (runs_dir / "tnl-mini").resolve(), tmp_path / "link"])
    assert [p.name for p in found] == ["tnl-mini", "tnl-tiny"]
    (runs_dir / "plots").mkdir()  # a folder that is not a run: passed over
    (runs_dir / "tnl-half").mkdir()
    (runs_dir / "tnl-half" / "config.json").write_text((runs_dir / "tnl-tiny" / "config.json").read_text())
    with pytest.raises(RunError, match="missing metrics.jsonl"):
        load_runs([runs_dir])
    runs, problems = load_runs([runs_dir], skip_bad=True)
    assert sorted(r.name for r in runs) == ["tnl-mini", "tnl-tiny"] and "tnl-half" in problems[0]


def test_config_without_seq_len_is_rejected(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model": model_config("tnl", "tiny").to_dict(), "train": {}}))
    (d / "metrics.jsonl").write_text("")
    with pytest.raises(RunError, match="seq_len"):
        load_run(d)


def test_a_run_with_no_usable_rows_is_named(tmp_path):
    cfg = model_config("tnl", "tiny")
    d = _write(tmp_path / "r", cfg, json.dumps({"step": 1, "tokens": 64, "loss": math.nan}) + "\n")
    with pytest.raises(RunError, match="no usable rows"):
        load_runs([d])


def test_a_copied_run_counts_once(tmp_path):
    """A run directory copied under another name (runs/x and runs/x.bak) is one run, named as a copy: as two, it
    met --min-runs at C where only that one size was trained and weighed twice in the fits. Two seeds of one size
    (other losses) stay two runs."""
    import shutil
    from scaling.analysis import FitSettings, analyze_arch
    runs_dir = tmp_path / "runs"
    law = LossLaw()
    write_run(runs_dir / "tnl-l1d32", model_config("tnl", "l1d32"), law, 3e7, n_rows=40)
    write_run(runs_dir / "tnl-l1d64", model_config("tnl", "l1d64"), law, 3e8, n_rows=40, early_rows=0)
    shutil.copytree(runs_dir / "tnl-l1d32", runs_dir / "tnl-l1d32.bak")
    runs, problems = load_runs([runs_dir])
    assert sorted(r.name for r in runs) == ["tnl-l1d32", "tnl-l1d64"]
    assert len(problems) == 1 and "tnl-l1d32.bak: a copy of" in problems[0] and "counted once" in problems[0]
    # the envelope of the study without the copy: every point where only the small size was logged has one run
    res = analyze_arch("tnl", runs, FitSettings(n_boot=0))
    small = next(r for r in runs if r.name == "tnl-l1d32")
    large = next(r for r in runs if r.name == "tnl-l1d64")
    only_small = res.envelope.c < large.compute[0] * (1 - 1e-9)
    assert only_small.any() and (res.envelope.coverage[only_small] == 1).all()
    assert not res.fit_mask[only_small].any()   # below --min-runs 2: not fitted
    assert small.compute[0] < large.compute[0]
    write_run(runs_dir / "tnl-l1d32-seed1", model_config("tnl", "l1d32"), law, 3e7, n_rows=40, noise=0.01, seed=1)
    runs, problems = load_runs([runs_dir])
    assert len(runs) == 3 and len(problems) == 1


def test_tokens_logged_in_billions_are_refused(tmp_path):
    """C is FLOPs per token x the logged tokens: a log that counts billions of tokens would put the run 1e9x too low
    in C with nothing else amiss. The log's tokens per step against the config's batch give it away; the error
    names both and the likely unit, and --skip-bad leaves the run out. A batch a few percent off (an inexact batch)
    is not such a slip."""
    cfg = model_config("tnl", "tiny")
    seq_len, batch = 64, 4
    rows = "".join(json.dumps({"step": s, "tokens": s * seq_len * batch / 1e9, "loss": 5.0 / s}) + "\n"
                   for s in range(1, 6))
    d = _write(tmp_path / "billions", cfg, rows, seq_len, batch)
    with pytest.raises(RunError, match=r"counts 2\.56e-07 tokens per step .* trains 256 per step .* billions"):
        load_runs([d])
    ok = _write(tmp_path / "ok", cfg, "".join(json.dumps({"step": s, "tokens": s * seq_len * 5, "loss": 5.0 / s})
                                             + "\n" for s in range(1, 6)), seq_len, batch)
    runs, problems = load_runs([d, ok], skip_bad=True)
    assert [r.name for r in runs] == ["ok"] and len(problems) == 1 and "billions" in problems[0]


def test_a_run_without_a_loss_log_says_why_and_what_to_do(tmp_path):
    """A run in a folder of runs with no metrics.jsonl, an empty one, or one whose rows hold no finite value of
    the fitted loss: the error names the run, what is wrong and the fix (--skip-bad; for a log of another loss,
    the --loss-key it does log); with --skip-bad the other runs are fitted and the reason is listed."""
    cfg = model_config("tnl", "tiny")
    good = write_run(tmp_path / "runs" / "tnl-mini", model_config("tnl", "mini"), LossLaw(), 1e6, n_rows=10)
    bad = _write(tmp_path / "runs" / "tnl-tiny", cfg, "")
    with pytest.raises(RunError, match=r"tnl-tiny: no usable rows in metrics.jsonl: it holds no rows .*--skip-bad"):
        load_runs([tmp_path / "runs"])
    rows = "".join(json.dumps({"step": s, "tokens": 256 * s, "val_loss": 3.0 - s / 10, "lr": 3e-4}) + "\n"
                   for s in range(1, 6))
    (bad / "metrics.jsonl").write_text(rows)
    with pytest.raises(RunError, match=r"no row has a finite 'loss', the loss fitted .*it logs val_loss "
                                       r"\(--loss-key val_loss fits that loss, in every run\); or leave the run out "
                                       r"with --skip-bad"):
        load_runs([tmp_path / "runs"])
    assert len(load_runs([bad], loss_key="val_loss")[0][0].tokens) == 5   # the loss it does log
    (bad / "metrics.jsonl").unlink()
    with pytest.raises(RunError, match=r"tnl-tiny: not a run directory \(missing metrics.jsonl, its loss log: a run "
                                       r"that has not logged a step yet.*Leave it out with --skip-bad"):
        load_runs([tmp_path / "runs"])
    runs, problems = load_runs([tmp_path / "runs"], skip_bad=True)
    assert [r.path for r in runs] == [good] and len(problems) == 1 and "tnl-tiny" in problems[0]
