"""What a scaling-law user meets at the edges of launch/fit_scaling.py: run directories damaged by hand, the loss a
fit describes (training or validation) named in every output, C in messages in the unit of the tables and of
--c-min/--c-max, flags that cannot do what they ask, and the synthetic-run writer's command line."""
import glob
import json
from pathlib import Path

import pytest

from launch_utils import load_launch_script
from models.sizes import model_config
from scaling.analysis import FitSettings, analyze_arch
from scaling.runs import load_runs
from scaling.synthetic import LossLaw, write_run, write_sweep
from scaling.units import flops_to_pflop_days


def _cli():
    return load_launch_script("fit_scaling").main


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """Three TNL sizes from a known law, each row also carrying a validation loss 5% above its training loss."""
    root = tmp_path_factory.mktemp("probe_sweep")
    write_sweep(root, "tnl", ["70m", "160m", "410m"], LossLaw(), noise=0.005, n_rows=60, seed=2, early_rows=20)
    for metrics in root.glob("*/metrics.jsonl"):
        rows = [json.loads(line) for line in metrics.read_text().splitlines()]
        for row in rows:
            row["val_loss"] = row["loss"] * 1.05
        metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


@pytest.mark.parametrize("case", ["list", "train_str", "optim_list", "binary"])
def test_a_config_json_of_the_wrong_shape_is_one_error_line(sweep, tmp_path, capsys, case):
    """A config.json that is JSON but not the trainer's object (a list; 'train' or 'optim' not an object), or not
    text at all: one `error:` line naming the run and the file, exit 2; --skip-bad leaves the run out."""
    bad = tmp_path / "bad"
    write_run(bad, model_config("tnl", "70m"), LossLaw(), 1e8, n_rows=20)
    config = json.loads((bad / "config.json").read_text())
    if case == "list":
        (bad / "config.json").write_text("[]")
    elif case == "binary":
        (bad / "config.json").write_bytes(b"\xff\xfe\x00\x01 not text")
    else:
        key = case.split("_")[0]
        config[key] = "2048" if case.endswith("str") else [1, 2]
        (bad / "config.json").write_text(json.dumps(config))
    main = _cli()
    assert main([str(bad), str(sweep), "--n-boot", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err
    assert str(bad) in err and "config.json" in err
    assert main([str(bad), str(sweep), "--n-boot", "0", "--skip-bad"]) == 0
    out = capsys.readouterr().out
    assert f"left out: {bad}: config.json" in out


def test_the_fitted_loss_is_named_in_every_output(sweep, tmp_path, capsys, monkeypatch):
    """--loss-key val_loss fits the validation loss: the JSON's unit of L, its loss_key, the tables and the plot
    axes say so (not "training loss"), and the JSON records the row selection; the default names the training
    loss."""
    import scaling.plots

    ylabels: list[str] = []
    real_finish = scaling.plots._finish

    def finish(fig, axes, labels, *args, **kwargs):
        ylabels.append(labels[0])
        return real_finish(fig, axes, labels, *args, **kwargs)
    monkeypatch.setattr(scaling.plots, "_finish", finish)
    out, md = tmp_path / "fits.json", tmp_path / "table.md"
    main = _cli()
    assert main([str(sweep), "--loss-key", "val_loss", "--n-boot", "0", "--skip-tokens", "1e6", "--json", str(out),
                 "--markdown", str(md), "--plots", str(tmp_path / "plots")]) == 0
    console = capsys.readouterr().out
    rec = json.loads(out.read_text())
    assert rec["loss_key"] == "val_loss"
    assert rec["units"]["L"].startswith("validation loss") and "training" not in rec["units"]["L"]
    assert rec["selection"] == {"skip_tokens": 1e6, "skip_warmup": False, "seq_len": None}
    table = md.read_text()
    assert "L the validation loss (metrics.jsonl `val_loss`" in table.splitlines()[0]
    assert "our L(C) is the validation loss, the paper's the training loss" in table
    assert "L: the validation loss" in console.splitlines()[0]
    assert ylabels == ["validation loss (nats/token)", "validation loss (envelope and fit, nats/token)"]
    # the L fitted is the validation loss indeed: 5% above the training loss at C = 1 PFLOP-day
    val_beta = rec["archs"]["tnl"]["beta"]
    ylabels.clear()
    assert main([str(sweep), "--n-boot", "0", "--skip-tokens", "1e6", "--json", str(out), "--markdown", str(md),
                 "--plots", str(tmp_path / "plots")]) == 0
    rec = json.loads(out.read_text())
    assert rec["loss_key"] == "loss" and rec["units"]["L"].startswith("training loss")
    assert "the paper's the training loss" not in md.read_text()
    assert ylabels == ["training loss (nats/token)", "training loss (envelope and fit, nats/token)"]
    assert val_beta / rec["archs"]["tnl"]["beta"] == pytest.approx(1.05, rel=1e-6)


def test_c_in_handover_messages_is_in_pflop_days(tmp_path):
    """The C a handover note or warning names is in PFLOP-days, as in the tables and in --c-min/--c-max (a note
    "outside --c-min/--c-max" that printed FLOPs against bounds given in PFLOP-days read as a unit mismatch):
    checked against the runs' own C, converted by hand (1 PFLOP-day = 8.64e19 FLOPs)."""
    # short runs: each smaller size stops before the next one overtakes it
    write_sweep(tmp_path / "short", "tnl", ["70m", "160m", "410m"], LossLaw(), tokens_per_param=5, n_rows=60,
                early_rows=20)
    runs, _ = load_runs(sorted(glob.glob(str(tmp_path / "short" / "*"))))
    res = analyze_arch("tnl", runs, FitSettings(n_boot=0))
    by_name = {r.name: r for r in runs}
    ahead = [h for h in res.optimal.handovers if h.status == "smaller_ahead"]
    assert [h.small for h in ahead] == ["70m", "160m"]
    for h in ahead:
        end = float(by_name[f"tnl-{h.small}"].compute[-1]) / 8.64e19     # the smaller run's last C, PFLOP-days
        assert f"where their overlap ends ({end:.3g} PFLOP-days)" in h.reason
        assert " FLOPs" not in h.reason
    assert any(f"({flops_to_pflop_days(by_name['tnl-70m'].compute[-1]):.3g} PFLOP-days)" in w for w in res.warnings)

    # long runs: both handovers observed; a --c-min between them leaves the first out, and the note says where
    write_sweep(tmp_path / "long", "tnl", ["70m", "160m", "410m"], LossLaw(), n_rows=60, early_rows=20)
    runs, _ = load_runs(sorted(glob.glob(str(tmp_path / "long" / "*"))))
    first, second = analyze_arch("tnl", runs, FitSettings(n_boot=0)).optimal.used
    c_first = first.c / 8.64e19
    c_min = (c_first * second.c / 8.64e19) ** 0.5
    res = analyze_arch("tnl", runs, FitSettings(n_boot=0, c_min=c_min))
    note = next(n for n in res.notes if "outside --c-min/--c-max" in n)
    assert f"handover 70m -> 160m at {c_first:.3g} PFLOP-days is outside --c-min/--c-max" in note


def test_skip_warmup_that_cannot_find_the_warmup_is_named(sweep, capsys):
    """--skip-warmup on runs whose config.json has no optim.warmup_steps drops nothing: the console says so rather
    than fitting their warm-up rows as if they had been left out."""
    main = _cli()
    assert main([str(sweep), "--n-boot", "0", "--skip-warmup"]) == 0
    out = capsys.readouterr().out
    assert "WARNING --skip-warmup drops nothing of 3 run(s)" in out and "optim.warmup_steps" in out


def test_flags_that_cannot_both_hold(sweep, capsys):
    """--embedding-flops with --no-embedding-flops is refused (which C would the tables be in?); --smooth with the
    fitted envelope, which does not use the logged losses it smooths, is named."""
    main = _cli()
    assert main([str(sweep), "--embedding-flops", "--no-embedding-flops", "--n-boot", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --embedding-flops and --no-embedding-flops")
    assert main([str(sweep), "--smooth", "0.05", "--n-boot", "0"]) == 0
    assert "WARNING --smooth 0.05 smooths the logged losses of --envelope logged" in capsys.readouterr().out
    assert main([str(sweep), "--smooth", "0.05", "--envelope", "logged", "--n-boot", "0"]) == 0
    assert "WARNING --smooth" not in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--rows", "0"], "argument --rows: 0: out of range; allowed: >= 1"),
    (["--noise", "-0.01"], "argument --noise: -0.01: out of range; allowed: >= 0"),
    (["--sizes", "70x"], "error: unknown size '70x'"),
    (["--arch", "mamba"], "error: unknown arch 'mamba'"),
])
def test_synthetic_writer_bad_values_are_usage_errors(tmp_path, capsys, argv, message):
    """python -m scaling.synthetic (the worked example's runs): a bad value is one error line and exit 2."""
    from scaling.synthetic import main
    try:
        rc = main([str(tmp_path / "out"), *argv])
    except SystemExit as stop:     # argparse's usage error
        rc = stop.code
    assert rc == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
