"""Scaling fits against laws we know: the fitters on exact power laws with noise, the envelope against a brute-force
minimum of the generating law, and end to end from synthetic runs to the frontier exponents of the law."""
import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from models.sizes import model_config
from scaling.analysis import FitSettings, analyze_arch
from scaling.chinchilla import fit_chinchilla
from scaling.envelope import build_envelope
from scaling.fits import fit_offset_power_law, fit_power_law
from scaling.runs import load_runs
from scaling.synthetic import LossLaw, write_run, write_sweep

ROOT = Path(__file__).resolve().parents[1]
SIZES = ["tiny", "mini", "70m", "160m", "410m", "1b", "3b", "7b"]


def _cli():
    spec = importlib.util.spec_from_file_location("fit_scaling", ROOT / "launch" / "fit_scaling.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, LossLaw]:
    """TNL at all eight registry sizes from a law without irreducible loss, 0.5% multiplicative noise."""
    root = tmp_path_factory.mktemp("sweep")
    law = LossLaw(E=0.0)
    write_sweep(root, "tnl", SIZES, law, noise=0.005, n_rows=200, seed=1)
    return root, law


def test_power_law_recovered_from_noisy_points():
    rng = np.random.default_rng(0)
    x = np.logspace(-3, 3, 120)
    y = 3.5391 * x ** -0.0768 * np.exp(0.01 * rng.standard_normal(len(x)))
    f = fit_power_law(x, y, n_boot=500, seed=0)
    assert f.exponent == pytest.approx(-0.0768, abs=0.002)
    assert f.coef == pytest.approx(3.5391, rel=0.01)
    assert f.exponent_ci[0] < -0.0768 < f.exponent_ci[1]
    assert f.coef_ci[0] < 3.5391 < f.coef_ci[1]
    assert f.exponent_ci[1] - f.exponent_ci[0] < 0.005


def test_power_law_through_two_points_is_exact_and_one_point_is_refused():
    f = fit_power_law([1.0, 100.0], [4.0, 1.0], n_boot=0)
    assert f.exponent == pytest.approx(np.log(0.25) / np.log(100))
    assert f.coef == pytest.approx(4.0)
    with pytest.raises(ValueError, match=">= 2 points"):
        fit_power_law([1.0, 1.0], [2.0, 3.0])


def test_offset_power_law_recovers_eps_and_exponent():
    rng = np.random.default_rng(1)
    x = np.logspace(-4, 3, 150)
    y = (1.7 + 0.8 * x ** -0.16) * np.exp(0.002 * rng.standard_normal(len(x)))
    f = fit_offset_power_law(x, y, n_boot=30, seed=0)
    assert f.eps == pytest.approx(1.7, abs=0.05)
    assert f.exponent == pytest.approx(-0.16, abs=0.01)
    assert f.coef == pytest.approx(0.8, rel=0.05)
    assert f.eps_ci[0] <= f.eps <= f.eps_ci[1]


def test_chinchilla_recovers_the_law():
    rng = np.random.default_rng(2)
    law = LossLaw(E=1.8, A=350.0, B=500.0, alpha=0.32, beta=0.27)
    n = np.repeat(np.logspace(6, 10, 7), 25)
    d = np.tile(np.logspace(8, 12, 25), 7)
    loss = law(n, d) * np.exp(0.002 * rng.standard_normal(len(n)))
    f = fit_chinchilla(n, d, loss, n_starts=4)
    assert f.E == pytest.approx(1.8, abs=0.05)
    assert f.alpha == pytest.approx(0.32, abs=0.02)
    assert f.beta == pytest.approx(0.27, abs=0.02)
    assert f.a == pytest.approx(law.a, abs=0.02)
    with pytest.raises(ValueError, match=">= 2 model sizes"):
        fit_chinchilla(np.full(10, 1e8), d[:10], loss[:10])


def test_envelope_picks_the_lowest_run_at_each_c(tmp_path):
    law = LossLaw()
    sizes = ["tiny", "mini", "70m", "160m"]
    write_sweep(tmp_path, "hgrn2", sizes, law, tokens_per_param=300, n_rows=400)
    runs, _ = load_runs([tmp_path], include_embedding=True)
    env = build_envelope(runs, points_per_decade=30)
    # reference: the generating law at every run inside its logged range, minimum by brute force
    table = np.full((len(runs), len(env.c)), np.inf)
    for i, r in enumerate(runs):
        inside = (env.c >= r.compute[0] * (1 - 1e-9)) & (env.c <= r.compute[-1] * (1 + 1e-9))
        table[i, inside] = law(r.n_params, env.c[inside] / r.flops_per_token)
    best = table.min(axis=0)
    second = np.sort(table, axis=0)[1]
    clear = (second - best) / best > 1e-3   # away from crossovers, where interpolation error could flip it
    assert clear.sum() > 0.8 * len(env.c)
    np.testing.assert_array_equal(env.winner[clear], table.argmin(axis=0)[clear])
    np.testing.assert_allclose(env.loss, best, rtol=2e-3)
    assert len(set(env.winner.tolist())) == len(sizes)     # every size wins somewhere
    # a run never wins outside its own C range
    for i, r in enumerate(runs):
        won = env.c[env.winner == i]
        assert won.min() >= r.compute[0] * (1 - 1e-9) and won.max() <= r.compute[-1] * (1 + 1e-9)


def test_exponents_of_the_law_recovered_end_to_end(sweep):
    root, law = sweep
    runs, _ = load_runs([root], include_embedding=False)   # C ∝ N*D holds only without the LM-head term
    res = analyze_arch("tnl", runs, FitSettings(n_boot=200, n_boot_offset=0))
    assert not res.notes
    # frontier of L = A/N^alpha + B/D^beta with C ∝ N*D: L ∝ C^(-alpha beta/(alpha+beta)), N ∝ C^a, D ∝ C^b.
    # The tolerances cover the discrete sizes (x2.5-8 apart) and the FLOPs terms not proportional to N.
    assert res.loss_fit.exponent == pytest.approx(law.loss_exponent, abs=0.01)
    assert res.n_fit.exponent == pytest.approx(law.a, abs=0.04)
    assert res.d_fit.exponent == pytest.approx(law.b, abs=0.04)
    assert res.loss_fit.r2 > 0.99


def test_irreducible_loss_recovered_by_the_eps_form(tmp_path):
    law = LossLaw(E=1.69)
    write_sweep(tmp_path, "tnl", SIZES, law, noise=0.002, n_rows=150, seed=4)
    runs, _ = load_runs([tmp_path], include_embedding=False)
    res = analyze_arch("tnl", runs, FitSettings(n_boot=0, n_boot_offset=0))
    assert res.offset_fit.eps == pytest.approx(1.69, abs=0.06)
    assert res.offset_fit.exponent == pytest.approx(law.loss_exponent, abs=0.015)
    # a pure power law cannot follow the curvature of E + power: its log residuals are larger
    assert res.offset_fit.rmse_log < 0.5 * np.sqrt(1 - res.loss_fit.r2) * np.std(np.log(res.envelope.loss[res.fit_mask]))


def test_single_size_is_explained_not_fitted(tmp_path):
    write_run(tmp_path / "a", model_config("llama", "mini"), LossLaw(), 1e8, n_rows=50)
    write_run(tmp_path / "b", model_config("llama", "mini"), LossLaw(), 1e8, n_rows=20, seed=1)
    runs, _ = load_runs([tmp_path])
    res = analyze_arch("llama", runs)
    assert res.loss_fit is None and res.n_fit is None
    assert any(">= 2 sizes" in n for n in res.notes)


def test_cli_writes_table_json_and_plots(sweep, tmp_path, capsys):
    root, _ = sweep
    # a second arch with a single size: reported, not fatal
    write_run(root.parent / "single" / "llama-mini", model_config("llama", "mini"), LossLaw(), 1e8, n_rows=30)
    out = tmp_path / "fits.json"
    rc = _cli()([str(root), str(root.parent / "single"), "--json", str(out), "--plots", str(tmp_path / "plots"),
                 "--no-embedding-flops", "--n-boot", "0"])   # no intervals: NaN internally, null in the JSON
    text = capsys.readouterr().out
    assert rc == 0
    assert "PFLOP-days" in text and "| tnl |" in text and ">= 2 sizes" in text
    rec = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    tnl = rec["archs"]["tnl"]
    for key in ("alpha", "beta", "a", "b", "n_coef", "d_coef", "beta_flops", "eps_power_law", "paper"):
        assert key in tnl
    assert tnl["paper"]["alpha"] == -0.0768 and "PFLOP-days" in tnl["paper"]["unit"]
    assert rec["include_embedding_flops"] is False and "PFLOP-days" in rec["units"]["C"]
    # the FLOPs-unit coefficient predicts the same loss as the PFLOP-days one
    c_flops = 1e20
    assert tnl["beta_flops"] * c_flops ** tnl["alpha"] == pytest.approx(tnl["beta"] * (c_flops / 8.64e19) ** tnl["alpha"])
    assert "alpha" not in rec["archs"]["llama"]
    assert tnl["alpha_ci"] == [None, None]
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["scaling_compare.png", "scaling_llama.png", "scaling_tnl.png"]
    assert all((tmp_path / "plots" / p).stat().st_size > 10_000 for p in pngs)


def test_cli_errors(tmp_path, capsys):
    main = _cli()
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no run directories" in capsys.readouterr().err
    write_run(tmp_path / "one" / "tnl-mini", model_config("tnl", "mini"), LossLaw(), 1e8, n_rows=30)
    assert main([str(tmp_path / "one")]) == 1
    captured = capsys.readouterr()
    assert ">= 2 sizes" in captured.out and "no architecture could be fitted" in captured.err
