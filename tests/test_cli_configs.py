"""The command lines of launch/evaluate.py and launch/fit_scaling.py are derived from their config
dataclasses (pretrain.cli): every flag sets exactly its field, the flag names are the documented ones, and
bad values are refused by argparse with the allowed choices."""
import dataclasses
from pathlib import Path

import pytest

from evaluation.sweep import SweepConfig
from launch_utils import load_launch_script
from pretrain.cli import flag_name, parse_config_args
from scaling.analysis import FitSettings
from scaling.fit_config import FitScalingConfig

def _launcher(name: str):
    return load_launch_script(name)


def test_evaluate_flags_map_one_to_one_onto_the_sweep_config(tmp_path):
    evaluate = _launcher("evaluate")
    argv = [str(tmp_path), "--suite", "paper", "--tasks", "wikitext2", "valid_loss", "--out", "o", "--device", "cpu",
            "--dtype", "bfloat16", "--batch-size", "3", "--limit", "5", "--max-length", "64",
            "--niah-lengths", "128", "256", "--niah-depths", "0", "50.5", "--niah-trials", "2",
            "--niah-scoring", "partial", "--niah-threshold", "7", "--niah-haystack", "a.txt",
            "--valid-shards", "s*.bin", "--valid-seq-len", "32", "--valid-windows", "4", "--force"]
    cfg = evaluate.parse_args(argv)
    want = SweepConfig(runs=[str(tmp_path)], suite="paper", tasks=["wikitext2", "valid_loss"], out="o", device="cpu",
                       dtype="bfloat16", batch_size=3, limit=5, max_length=64, niah_lengths=[128, 256],
                       niah_depths=[0.0, 50.5], niah_trials=2, niah_scoring="partial", niah_threshold=7.0,
                       niah_haystack=["a.txt"], valid_shards=["s*.bin"], valid_seq_len=32, valid_windows=4, force=True)
    assert cfg == want
    # every field but the code-only `plots` differs from its default here: the argv above names every flag
    defaults = evaluate.parse_args([str(tmp_path)])
    assert defaults == SweepConfig(runs=[str(tmp_path)])
    changed = {f.name for f in dataclasses.fields(SweepConfig) if getattr(cfg, f.name) != getattr(defaults, f.name)}
    assert changed == {f.name for f in dataclasses.fields(SweepConfig)} - {"plots", "runs"}
    with pytest.raises(SystemExit):
        evaluate.parse_args([str(tmp_path), "--niah-scoring", "fuzzy"])


def test_fit_scaling_flags_map_one_to_one_onto_its_config():
    fit = _launcher("fit_scaling")
    cls = FitScalingConfig
    flags = {flag_name(f) for f in dataclasses.fields(cls) if not f.metadata.get("positional")}
    # the documented flags (docs/scaling.md, the study's fit args) keep their names
    assert flags == {"--json", "--markdown", "--plots", "--embedding-flops", "--no-embedding-flops", "--chinchilla",
                     "--chinchilla-boot", "--chinchilla-max-tokens",
                     "--loss-key", "--skip-tokens", "--skip-warmup", "--seq-len", "--points-per-decade", "--envelope",
                     "--smooth", "--min-runs", "--c-min", "--c-max", "--n-boot", "--block", "--seed", "--skip-bad"}
    cfg = fit.parse_args(["r1", "r2", "--json", "f.json", "--embedding-flops", "--envelope", "logged", "--smooth",
                          "0.02", "--c-min", "1e-6", "--n-boot", "0", "--block", "7", "--seed", "3", "--skip-warmup"])
    assert cfg.runs == ["r1", "r2"] and cfg.json == Path("f.json") and cfg.embedding_flops and cfg.skip_warmup
    s = cfg.settings()
    assert (s.envelope, s.smooth_decades, s.c_min, s.n_boot, s.n_boot_offset, s.block, s.seed) == \
        ("logged", 0.02, 1e-6, 0, 0, 7, 3)
    assert fit.parse_args(["r"]).settings() == FitSettings()  # the fit's defaults are the CLI's
    with pytest.raises(SystemExit):
        fit.parse_args(["r", "--envelope", "smooth"])


def test_a_flag_needs_a_default_or_a_position():
    @dataclasses.dataclass
    class Bad:
        x: int

    with pytest.raises(TypeError, match="Bad.x: a flag needs a default"):
        parse_config_args(Bad, [])
