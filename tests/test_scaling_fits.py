"""Scaling fits against laws we know: the fitters on exact power laws with noise, the learning-curve fit against
least squares, the envelope (and the status of each of its points) against a brute-force minimum of the
generating law, and synthetic studies in the trainer's run format, fitted by launch/fit_scaling.py, against the
exact compute-optimal frontier of the law that generated them."""
import json
from pathlib import Path

import numpy as np
import pytest

from launch_utils import load_launch_script
from models.accounting import paper_non_embedding_params
from models.sizes import model_config
from scaling.analysis import FitSettings, analyze_arch
from scaling.chinchilla import fit_chinchilla, frontier as law_frontier, loglog_interpolator
from scaling.curves import fit_curves, row_weights
from scaling.envelope import build_envelope
from scaling.fits import fit_offset_power_law, fit_power_law
from scaling.paper import PAPER_TABLE3, paper_law_at, paper_reference
from scaling.runs import load_runs
from scaling.synthetic import LossLaw, frontier, frontier_exponents, write_run, write_sweep

SIZES = ["tiny", "mini", "70m", "160m", "410m", "1b", "3b", "7b"]
PAPER_SIZES = ["70m", "160m", "410m", "1b", "3b", "7b"]
LAW_618 = LossLaw(E=1.8, A=40.0, B=845.0, alpha=0.2, beta=0.3236)   # a = beta/(alpha+beta) = 0.618, D_opt ~ 20 N at 1B


def _cli():
    return load_launch_script("fit_scaling").main


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> tuple[Path, LossLaw]:
    """TNL at all eight registry sizes from a law without irreducible loss, 0.5% multiplicative noise."""
    root = tmp_path_factory.mktemp("sweep")
    law = LossLaw(E=0.0)
    write_sweep(root, "tnl", SIZES, law, noise=0.005, n_rows=200, seed=1, early_rows=30)
    return root, law


def true_exponents(law: LossLaw, runs, c_lo: float, c_hi: float) -> tuple[float, float]:
    """Exponents of the law's exact frontier over [c_lo, c_hi] FLOPs with the runs' own FLOPs per token: the
    reference, computed by minimising the law (scaling.synthetic.frontier), without any of the fitting code."""
    sizes = {(float(r.n_params), r.flops_per_token) for r in runs}
    return frontier_exponents(law, sorted(sizes), c_lo, c_hi)


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


def test_case_bootstrap_gives_no_interval_from_too_few_points():
    """A case bootstrap over points needs points beyond the parameter count: through two points every resample with
    both of them is the same exact line, so the "95%" interval had width 0 (and held the truth in no seed), and with
    one spare point it held it in about 2 of 3. Too few points get no interval, as `n_boot=0` does; from two spare
    points on, the interval holds the truth about as often as it says (checked here over seeded noisy laws)."""
    f = fit_power_law([1.0, 100.0], [4.0, 1.0], n_boot=200)
    assert np.isnan(f.exponent_ci).all() and np.isnan(f.coef_ci).all() and f.ci_method == "none"
    assert f.exponent == pytest.approx(np.log(0.25) / np.log(100))          # the fit itself is unchanged
    assert fit_power_law([1.0, 10.0, 100.0], [4.0, 2.1, 1.0], n_boot=200).ci_method == "none"
    x = np.geomspace(1e-5, 1e3, 4)
    g = fit_offset_power_law(x, 1.7 + 2 * x ** -0.15, n_boot=30)
    assert np.isnan(g.exponent_ci).all() and g.ci_method == "none"
    rng = np.random.default_rng(0)
    held = []
    for seed in range(200):
        x = np.geomspace(1e-3, 1e3, 4)
        f = fit_power_law(x, 3 * x ** -0.1 * np.exp(0.02 * rng.standard_normal(4)), n_boot=300, seed=seed)
        assert f.ci_method == "points"
        held.append(f.exponent_ci[0] <= -0.1 <= f.exponent_ci[1])
    assert np.mean(held) > 0.85


def test_replicate_intervals_are_symmetric_about_the_estimate():
    """The interval is the estimate ± the longer of its distances to the replicates' 2.5th and 97.5th
    percentiles (by hand on 0..100, where those are 2.5 and 97.5); the coefficient's is taken in log space."""
    from scaling.fits import PowerLawFit, symmetric_interval, with_replicate_intervals
    samples = np.arange(101.0)
    assert symmetric_interval(10.0, samples, 0.95) == pytest.approx((10 - 87.5, 10 + 87.5))
    assert symmetric_interval(95.0, samples, 0.95) == pytest.approx((95 - 92.5, 95 + 92.5))
    assert symmetric_interval(50.0, samples, 0.90) == pytest.approx((50 - 45, 50 + 45))
    assert np.isnan(symmetric_interval(1.0, np.array([np.nan]), 0.95)).all()
    fit = PowerLawFit(coef=np.e, exponent=0.5, coef_ci=(0, 0), exponent_ci=(0, 0), n_points=5, r2=1.0)
    with_replicate_intervals(fit, 0.5 + (samples - 50) / 1000, 1.0 + (samples - 40) / 100, 0.95)
    assert fit.exponent_ci == pytest.approx((0.5 - 0.0475, 0.5 + 0.0475))
    assert fit.coef_ci == pytest.approx((np.exp(1 - 0.575), np.exp(1 + 0.575)))   # log 97.5th: 1 + 0.575
    assert fit.ci_method == "runs" and fit.n_replicates == 101


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


def test_loglog_interpolator_is_exact_at_the_sizes_and_extends_the_end_slopes():
    f = loglog_interpolator([(1e4, 2e5), (1e5, 8e5), (1e6, 4e6)])
    assert f(np.array([1e4, 1e5, 1e6])) == pytest.approx([2e5, 8e5, 4e6], rel=1e-12)
    assert f(1e3) == pytest.approx(2e5 * 10 ** -np.log10(4))                  # the first segment's slope, log10(4)
    assert f(1e7) == pytest.approx(4e6 * 5)                                   # the last one's, log10(5)
    assert f(np.sqrt(1e4 * 1e5)) == pytest.approx(np.sqrt(2e5 * 8e5))
    with pytest.raises(ValueError, match="positive"):
        loglog_interpolator([(1e4, 0.0), (1e5, 1.0)])


def test_law_frontier_matches_scalar_minimisation():
    """The vectorised grid + parabola search against scipy's bounded minimiser (scaling.synthetic.frontier), under
    FLOPs per token far from 6N; no optimum inside the searched range is NaN, not the range's edge."""
    law = LossLaw(E=1.7, A=300.0, B=500.0, alpha=0.3, beta=0.25)
    fpt = loglog_interpolator([(1e4, 2.5e5), (1e5, 1.1e6), (1e6, 7.5e6), (1e7, 6.5e7)])
    c = np.geomspace(1e13, 1e19, 7)
    n_opt, d_opt = law_frontier(law, fpt, c, (1e4, 1e7))
    n_ref, d_ref = frontier(law, fpt, c, (1.0, 1e11))
    assert n_opt == pytest.approx(n_ref, rel=2e-3)
    assert d_opt == pytest.approx(d_ref, rel=2e-3)
    flat = LossLaw(E=1.7, A=300.0, B=500.0, alpha=0.0, beta=0.25)              # N does not help: N_opt -> 0
    assert np.isnan(law_frontier(flat, fpt, c, (1e4, 1e7))[0]).all()


TINY_LADDER = ["l1d32", "l1d48", "l1d64", "l1d96", "l1d128", "l2d128", "l2d256", "l4d256"]


def test_chinchilla_allocation_recovers_a_and_b_under_the_studys_flops(tmp_path):
    """A synthetic study on the mini study's ladder (LLaMA, seq_len 512: attention and LM-free FLOPs per token of
    7-21 N, far from 6N) from a known L(N, D): approach 3's N_opt(C), D_opt(C) exponents, computed under the
    architecture's own C(N, D), match the law's exact frontier over the same C range within 0.015, and their
    bootstrap intervals hold it. a = β/(α+β), b = α/(α+β) (exact only if C ∝ N·D) miss b by more than that."""
    law = LossLaw()
    paths = write_sweep(tmp_path, "llama", TINY_LADDER, law, tokens_per_param=400, seed=1, noise=0.01,
                        seq_len=512, global_batch=32)
    runs, _ = load_runs([str(p) for p in paths], False, "loss", 0.0, False)
    r = analyze_arch("llama", runs, FitSettings(n_boot=0, chinchilla=True, chinchilla_boot=20))
    al = r.chinchilla_alloc
    assert al is not None and al.ci_method == "runs-bootstrap" and al.n_replicates >= 15
    c_flops = np.array(al.c_range) * 8.64e19
    true_a, true_b = frontier_exponents(law, [(x.n_params, x.flops_per_token) for x in runs], *c_flops)
    tol = 0.015
    assert al.n_fit.exponent == pytest.approx(true_a, abs=tol)
    assert al.d_fit.exponent == pytest.approx(true_b, abs=tol)
    assert al.n_fit.exponent_ci[0] <= true_a <= al.n_fit.exponent_ci[1]
    assert al.d_fit.exponent_ci[0] <= true_b <= al.d_fit.exponent_ci[1]
    assert abs(al.implied_b - true_b) > 3 * tol                     # the C ∝ N·D shortcut would fail this test
    # the coefficient: N_opt at the middle of the range within 10% of the law's exact optimum there
    c_mid = np.sqrt(c_flops[0] * c_flops[1])
    fpt = loglog_interpolator([(x.n_params, x.flops_per_token) for x in runs])
    n_true = frontier(law, fpt, np.array([c_mid]), (1e2, 1e9))[0][0]
    assert al.n_fit(c_mid / 8.64e19) == pytest.approx(n_true, rel=0.1)


def test_chinchilla_max_tokens_leaves_later_rows_out(sweep):
    from scaling.analysis import chinchilla_points
    root, _ = sweep
    runs, _ = load_runs([str(root)], False, "loss", 0.0, False)
    c = np.geomspace(min(r.compute[0] for r in runs), max(r.compute[-1] for r in runs), 200)
    n, d, _ = chinchilla_points(runs, c)
    n2, d2, _ = chinchilla_points(runs, c, max_tokens=1e9)
    assert d.max() > 1e9 >= d2.max() and len(d2) == (d <= 1e9).sum()


def test_learning_curve_fit_matches_least_squares():
    """The vectorised fit of L(D) = e + b·D^-beta (a scan over beta with closed-form e, b) against scipy's
    least squares on the weighted log residual, on noisy rows; exact on noise-free rows."""
    from scipy.optimize import least_squares
    d = np.concatenate([np.geomspace(2e6, 2e7, 30), np.linspace(2.5e7, 2e9, 300)])
    truth = 2.1 + 420.0 * d ** -0.29
    exact = fit_curves(np.log(d), np.log(truth))
    scale = exact.b[0] * exact.d_ref ** exact.beta[0]
    assert (exact.e[0], scale, exact.beta[0]) == pytest.approx((2.1, 420.0, 0.29), rel=1e-5)
    rng = np.random.default_rng(3)
    y = np.log(truth) + 0.01 * rng.standard_normal((3, len(d)))
    got = fit_curves(np.log(d), y)
    w = np.sqrt(row_weights(np.log(d)))
    for k in range(3):
        ref = least_squares(lambda p: w * (np.log(p[0] + np.exp(p[1] - p[2] * np.log(d))) - y[k]), [1.5, 6.0, 0.25],
                            bounds=([0, -np.inf, 1e-3], [np.exp(y[k]).min(), np.inf, 3]), xtol=1e-14, ftol=1e-14).x
        ours = got.log_loss(np.log(d))[k]
        theirs = np.log(ref[0] + np.exp(ref[1] - ref[2] * np.log(d)))
        # the same curve to well below the noise (the objectives differ only in relative vs log error)
        assert np.max(np.abs(ours - theirs)) < 1e-3
        assert got.beta[k] == pytest.approx(ref[2], rel=0.05)


def test_envelope_picks_the_lowest_run_at_each_c(tmp_path):
    law = LossLaw()
    sizes = ["tiny", "mini", "70m", "160m"]
    write_sweep(tmp_path, "hgrn2", sizes, law, tokens_per_param=300, n_rows=400, early_rows=40)
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
    # each point's status, from the runs' ranges and the law by hand: a smaller size competes where it is
    # present, or where it stopped after a larger size had overtaken it (at its last row, by the law)
    n = [r.n_params for r in runs]
    overtaken = [any(r2.n_params > r.n_params and r2.compute[0] <= r.compute[-1] <= r2.compute[-1]
                     and law(r2.n_params, r.compute[-1] / r2.flops_per_token) <= law(r.n_params, r.tokens[-1])
                     for r2 in runs) for r in runs]
    assert env.overtaken_runs().tolist() == overtaken and 0 < sum(overtaken) < len(runs)
    for j, (w, st) in enumerate(zip(env.winner, env.status)):
        present = [i for i in range(len(runs)) if np.isfinite(table[i, j])]
        beaten = [i for i in range(len(runs)) if overtaken[i] and env.c[j] > runs[i].compute[-1]]
        smaller = any(n[i] < n[w] for i in present + beaten)
        larger = any(n[i] > n[w] for i in present)
        assert st == {(True, True): "interior", (False, True): "edge_low", (True, False): "edge_high",
                      (False, False): "alone"}[(smaller, larger)]
    assert {"interior", "edge_low", "edge_high"} <= set(env.status.tolist())


def test_edge_won_staircase_is_biased_and_the_handovers_are_not(tmp_path):
    """Noise-free, the paper's six sizes: a line through the envelope's winners (the edge-won flat steps
    included) is far from the frontier exponents; the handover fit recovers them."""
    write_sweep(tmp_path, "tnl", PAPER_SIZES, LAW_618, early_rows=30)
    runs, _ = load_runs([tmp_path])
    res = analyze_arch("tnl", runs, FitSettings(n_boot=0))
    used = res.optimal.used
    assert len(used) == len(PAPER_SIZES) - 1 and not res.warnings
    c = np.exp(res.optimal.log_c[0])
    a, b = true_exponents(LAW_618, runs, c.min(), c.max())
    assert a == pytest.approx(LAW_618.a, abs=0.01)        # the paper's FLOPs are close to, not exactly, 6N·D
    assert res.n_fit.exponent == pytest.approx(a, abs=0.004)
    assert res.d_fit.exponent == pytest.approx(b, abs=0.004)
    env, m = res.envelope, res.fit_mask
    naive = np.polyfit(np.log(env.c[m]), np.log(env.n_opt[m]), 1)[0]
    assert naive < a - 0.05                                 # what fitting every winner gives
    st = res.edge_summary()
    assert st["edge_low"]["points"] > 0 and st["edge_high"]["points"] > 0


def test_more_sizes_do_not_remove_the_edge_bias_and_the_handovers_have_none(tmp_path):
    """Noise-free, sixteen uneven sizes from 3.7M to 7.7B: the line through every envelope winner is even further
    off than with six sizes (the edge-won steps stay as long as the edge runs), the handover fit still equals the
    exact frontier's exponents, and every handover point lies on the law's exact frontier (N_opt at that C)."""
    from scaling.synthetic import frontier, size_ladder
    ladder = size_ladder("tnl", 16)
    assert len({(c.n_layers, c.d_model) for c in ladder}) == 16
    write_sweep(tmp_path, "tnl", ladder, LAW_618, early_rows=30)
    runs, _ = load_runs([tmp_path])
    res = analyze_arch("tnl", runs, FitSettings(n_boot=0))
    assert len(res.optimal.used) == 15 and not res.warnings, res.warnings
    c = np.exp(res.optimal.log_c[0])
    a, b = true_exponents(LAW_618, runs, c.min(), c.max())
    assert res.n_fit.exponent == pytest.approx(a, abs=0.004)
    assert res.d_fit.exponent == pytest.approx(b, abs=0.004)
    env, m = res.envelope, res.fit_mask
    naive = np.polyfit(np.log(env.c[m]), np.log(env.n_opt[m]), 1)[0]
    assert naive < a - 0.1
    n, f = (np.array(v) for v in zip(*sorted({(float(r.n_params), r.flops_per_token) for r in runs})))
    n_true, _ = frontier(LAW_618, lambda x: float(np.exp(np.interp(np.log(x), np.log(n), np.log(f)))), c,
                         (n[0] / 20, n[-1] * 20))
    np.testing.assert_allclose(np.exp(res.optimal.log_n), n_true, rtol=0.01)


@pytest.mark.parametrize("seed", [1, 2])
def test_synthetic_study_recovers_a_and_b_within_the_intervals(tmp_path, seed):
    """Six sizes, 1% log-normal noise per logged row, written in the trainer's format and fitted by the CLI: the
    exact frontier exponents lie inside the 95% intervals, which are not uselessly wide (their coverage over
    many seeds is measured by launch/bench_scaling_calibration.py)."""
    write_sweep(tmp_path / "runs", "tnl", PAPER_SIZES, LAW_618, noise=0.01, seed=seed, early_rows=40)
    out = tmp_path / "fits.json"
    assert _cli()([str(tmp_path / "runs"), "--json", str(out), "--n-boot", "120", "--seed", str(seed)]) == 0
    rec = json.loads(out.read_text())["archs"]["tnl"]
    runs, _ = load_runs([tmp_path / "runs"])
    c = [h["c_pflop_days"] * 8.64e19 for h in rec["handovers"] if h["status"] == "ok"]
    assert len(c) == 5
    a, b = true_exponents(LAW_618, runs, min(c), max(c))
    assert rec["a_ci"][0] <= a <= rec["a_ci"][1], (a, rec["a"], rec["a_ci"])
    assert rec["b_ci"][0] <= b <= rec["b_ci"][1], (b, rec["b"], rec["b_ci"])
    assert rec["a_ci"][1] - rec["a_ci"][0] < 0.15 and rec["b_ci"][1] - rec["b_ci"][0] < 0.15
    assert rec["opt_ci_method"] == "runs" and rec["n_replicates"] >= 100
    by_status = rec["envelope_points_by_status"]
    assert by_status["edge_low"]["points"] > 0 and by_status["edge_high"]["points"] > 0   # reported


def test_exponents_of_the_law_recovered_end_to_end(sweep):
    root, law = sweep
    runs, _ = load_runs([root])
    res = analyze_arch("tnl", runs, FitSettings(n_boot=0))
    assert not res.notes
    # frontier of L = A/N^alpha + B/D^beta: L ∝ C^(-alpha beta/(alpha+beta)) (E = 0), N ∝ C^a, D ∝ C^b
    c = np.exp(res.optimal.log_c[0])
    a, b = true_exponents(law, runs, c.min(), c.max())
    assert res.loss_fit.exponent == pytest.approx(law.loss_exponent, abs=0.01)
    assert res.n_fit.exponent == pytest.approx(a, abs=0.02)
    assert res.d_fit.exponent == pytest.approx(b, abs=0.02)
    assert res.loss_fit.r2 > 0.99


def test_irreducible_loss_recovered_by_the_eps_form(tmp_path):
    law = LossLaw(E=1.69)
    write_sweep(tmp_path, "tnl", SIZES, law, noise=0.002, n_rows=150, seed=4)
    runs, _ = load_runs([tmp_path])
    res = analyze_arch("tnl", runs, FitSettings(n_boot=0, n_boot_offset=0))
    assert res.offset_fit.eps == pytest.approx(1.69, abs=0.06)
    assert res.offset_fit.exponent == pytest.approx(law.loss_exponent, abs=0.015)
    # a pure power law cannot follow the curvature of E + power: its log residuals are larger
    assert res.offset_fit.rmse_log < 0.5 * np.sqrt(1 - res.loss_fit.r2) * np.std(np.log(res.envelope.loss[res.fit_mask]))


def test_a_run_that_stops_while_winning_is_named(tmp_path):
    """160m stops long before 410m overtakes it: the envelope changes winner at 160m's last row, and the
    pair's handover is not observed. Both are reported, naming the run."""
    write_sweep(tmp_path, "tnl", ["70m", "410m", "1b"], LossLaw(), early_rows=30)
    write_run(tmp_path / "tnl-160m", model_config("tnl", "160m"), LossLaw(), 1.5e9, n_rows=100, early_rows=30)
    runs, _ = load_runs([tmp_path])
    res = analyze_arch("tnl", runs, FitSettings(n_boot=0))
    assert any("tnl-160m" in w and "while still winning" in w for w in res.warnings), res.warnings
    pair = [h for h in res.optimal.handovers if h.small == "160m"][0]
    assert pair.status == "smaller_ahead" and "tnl-160m" in pair.reason
    assert [h.status for h in res.optimal.handovers if h.small != "160m"] == ["ok", "ok"]
    # the unobserved pair still bounds N_opt where 160m stops: below 410m's N there, as the law's own optimum is
    run160, run410 = (next(r for r in runs if r.label == s) for s in ("160m", "410m"))
    c, rel, n = pair.n_opt_bound()
    assert rel == "<" and n == run410.n_params and c == pytest.approx(run160.compute[-1], rel=1e-9)
    ln = np.log([run160.n_params, run410.n_params])
    lf = np.log([run160.flops_per_token, run410.flops_per_token])
    fpt = lambda x: float(np.exp(lf[0] + (lf[1] - lf[0]) / (ln[1] - ln[0]) * (np.log(x) - ln[0])))
    assert frontier(LossLaw(), fpt, np.array([c]), (1e6, 1e11))[0][0] < n
    for h in res.optimal.handovers:
        if h.status == "ok":
            assert h.n_opt_bound() == (h.c, "≈", h.n) and h.n_small < h.n < h.n_large


def test_stopping_is_not_claimed_where_the_size_goes_on_or_was_overtaken(tmp_path):
    """No warning where none is due: a short run of a size whose longer run goes on (the size has not stopped),
    and a run overtaken between the envelope's last grid point inside it and its own last row (the crossing,
    computed from the law, lies inside the run)."""
    from scipy.optimize import brentq
    law = LossLaw()
    write_sweep(tmp_path / "a", "tnl", ["70m", "160m", "410m"], law, early_rows=30)
    write_run(tmp_path / "a" / "tnl-1-short", model_config("tnl", "160m"), law, 2e9, n_rows=60, early_rows=30)
    runs, _ = load_runs([tmp_path / "a"])
    assert runs[0].name == "tnl-1-short"                       # first, so it wins the ties with its longer twin
    res = analyze_arch("tnl", runs, FitSettings(n_boot=0))
    assert not [w for w in res.warnings if "while still winning" in w], res.warnings
    assert [h.status for h in res.optimal.handovers] == ["ok", "ok"]

    # 70m ends 2% past the C where 160m overtakes it; a coarse grid puts its last point well before that C
    small, large = model_config("tnl", "70m"), model_config("tnl", "160m")
    ref = tmp_path / "ref"
    write_run(ref / "s", small, law, 1e6, n_rows=4)
    write_run(ref / "l", large, law, 1e6, n_rows=4)
    (rs, rl), _ = load_runs([ref / "s", ref / "l"])
    gap = lambda lc: law(rs.n_params, np.exp(lc) / rs.flops_per_token) - law(rl.n_params, np.exp(lc) / rl.flops_per_token)
    c_x = float(np.exp(brentq(gap, np.log(1e15), np.log(1e21))))
    write_run(tmp_path / "b" / "tnl-70m", small, law, 1.02 * c_x / rs.flops_per_token, n_rows=300, early_rows=30)
    write_run(tmp_path / "b" / "tnl-160m", large, law, 400 * rl.n_params, n_rows=300, early_rows=30)
    runs, _ = load_runs([tmp_path / "b"])
    run70 = next(r for r in runs if r.label == "70m")
    assert run70.compute[-1] > c_x
    res = analyze_arch("tnl", runs, FitSettings(n_boot=0, points_per_decade=2))
    env = res.envelope
    inside = env.c[env.c <= run70.compute[-1] * (1 + 1e-9)]
    assert inside[-1] < c_x                                    # the grid alone would see 70m still winning
    assert not [w for w in res.warnings if "while still winning" in w], res.warnings
    assert res.optimal.handovers[0].status == "ok"
    # ... and the same run ended 2% before that C is named
    write_run(tmp_path / "b" / "tnl-70m", small, law, 0.98 * c_x / rs.flops_per_token, n_rows=300, early_rows=30)
    runs, _ = load_runs([tmp_path / "b"])
    res = analyze_arch("tnl", runs, FitSettings(n_boot=0, points_per_decade=2))
    assert any("tnl-70m" in w and "while still winning" in w for w in res.warnings), res.warnings


def test_single_size_is_explained_not_fitted(tmp_path):
    write_run(tmp_path / "a", model_config("llama", "mini"), LossLaw(), 1e8, n_rows=50)
    write_run(tmp_path / "b", model_config("llama", "mini"), LossLaw(), 1e8, n_rows=20, seed=1)
    runs, _ = load_runs([tmp_path])
    res = analyze_arch("llama", runs)
    assert res.loss_fit is None and res.n_fit is None
    assert any(">= 2 sizes" in n for n in res.notes)


def test_no_learning_curve_fit_gives_no_interval_rather_than_a_zero_width_one(tmp_path):
    """Three rows a run: no size has a learning-curve fit for the replicates to resample around, so the
    bootstrap would repeat the data and give an interval of width 0; L(C) comes without one, and says why."""
    for k, size in enumerate(("tiny", "mini")):
        write_run(tmp_path / f"llama-{size}", model_config("llama", size), LossLaw(), 1e8 * (k + 1), n_rows=3)
    runs, _ = load_runs([tmp_path])
    res = analyze_arch("llama", runs, FitSettings(n_boot=10, min_runs=1))
    assert res.loss_fit is not None and res.loss_fit.ci_method != "runs"
    lo, hi = res.loss_fit.exponent_ci if res.loss_fit.exponent_ci is not None else (np.nan, np.nan)
    assert not np.isfinite(lo) or lo < hi  # no interval, or a real one
    assert any("no size has a learning-curve fit" in n for n in res.notes)


def test_a_run_whose_loss_rises_at_its_end_is_warned_about(tmp_path):
    for k, size in enumerate(("tiny", "mini")):
        write_run(tmp_path / f"llama-{size}", model_config("llama", size), LossLaw(), 1e8 * (k + 1), n_rows=50)
    runs, _ = load_runs([tmp_path])
    assert not any("diverge" in w for w in analyze_arch("llama", runs).warnings)
    f = tmp_path / "llama-mini" / "metrics.jsonl"
    rows = [json.loads(line) for line in f.read_text().splitlines()]
    for r in rows[-8:]:
        r["loss"] *= 3
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs, _ = load_runs([tmp_path])
    warned = [w for w in analyze_arch("llama", runs).warnings if "diverge" in w]
    assert len(warned) == 1 and warned[0].startswith("run llama-mini")


def test_a_run_whose_loss_climbs_ten_percent_is_warned_about_and_noise_is_not(tmp_path):
    """1% noise: a run that climbs to 1.1x over its last 30% of rows (enough to move N_opt's exponent by several
    interval widths) is named; noisy runs that only flatten out are not, at 1% or 5% noise."""
    from scaling.analysis import end_rise
    rng = np.random.default_rng(0)
    d = np.linspace(1e8, 4e10, 400)
    for noise in (0.01, 0.05):
        for _ in range(20):
            clean = LAW_618(1e8, d) * np.exp(noise * rng.standard_normal(len(d)))
            assert end_rise(clean) is None
    write_sweep(tmp_path, "tnl", ["70m", "160m", "410m"], LAW_618, noise=0.01, early_rows=30)
    f = tmp_path / "tnl-160m" / "metrics.jsonl"
    rows = [json.loads(line) for line in f.read_text().splitlines()]
    start = int(0.7 * len(rows))
    for i, r in enumerate(rows[start:]):
        r["loss"] *= 1 + 0.1 * i / (len(rows) - start)
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs, _ = load_runs([tmp_path])
    warned = [w for w in analyze_arch("tnl", runs, FitSettings(n_boot=0)).warnings if "diverge" in w]
    assert len(warned) == 1 and warned[0].startswith("run tnl-160m"), warned


def test_no_handover_fits_the_loss_and_still_draws_every_panel(tmp_path, capsys):
    """Every size stops while it still wins (the smaller size is ahead wherever the pair overlaps): L(C) is fitted,
    N_opt and D_opt are not, and the plots are written all the same, the comparison's empty panels included."""
    for size in ("70m", "160m", "410m"):
        write_run(tmp_path / "runs" / f"tnl-{size}", model_config("tnl", size), LossLaw(), 3e8, n_rows=60,
                  early_rows=30)
    runs, _ = load_runs([tmp_path / "runs"])
    res = analyze_arch("tnl", runs, FitSettings(n_boot=0))
    assert [h.status for h in res.optimal.handovers] == ["smaller_ahead", "smaller_ahead"]
    assert res.loss_fit is not None and res.n_fit is None and res.d_fit is None
    out = tmp_path / "fits.json"
    assert _cli()([str(tmp_path / "runs"), "--json", str(out), "--plots", str(tmp_path / "plots"), "--n-boot", "0"]) == 0
    tnl = json.loads(out.read_text())["archs"]["tnl"]
    assert tnl["alpha"] < 0 and tnl.get("a") is None
    # each pair ends with the smaller size ahead: an upper bound on N_opt at the end of the pair's overlap
    ends = {r.label: r.compute[-1] for r in runs}
    ns = {r.label: r.n_params for r in runs}
    bounds = [h["n_opt_bound"] for h in tnl["handovers"]]
    assert [b["relation"] for b in bounds] == ["<", "<"]
    assert [b["n"] for b in bounds] == [ns["160m"], ns["410m"]]
    assert [b["c_pflop_days"] for b in bounds] == pytest.approx([ends["70m"] / 8.64e19, ends["160m"] / 8.64e19])
    assert (tmp_path / "plots" / "scaling_compare.png").stat().st_size > 10_000
    assert (tmp_path / "plots" / "scaling_tnl.png").stat().st_size > 10_000
    # the N_opt panel shows the two upper bounds where the pairs end, and the paper's TNL law over the C span
    import matplotlib.pyplot as plt
    from scaling.plots import _n_opt_evidence
    fig, ax = plt.subplots()
    assert _n_opt_evidence(ax, res, "k", (1e-3, 1.0), label=True)
    marks = [col.get_offsets()[0].tolist() for col in ax.collections]
    assert marks == [[pytest.approx(b["c_pflop_days"]), b["n"]] for b in bounds]
    (line,) = ax.get_lines()
    assert line.get_ydata()[-1] == pytest.approx(PAPER_TABLE3["tnl"]["N_opt"][0])     # N_opt(1 PFLOP-day)
    plt.close(fig)


def test_paper_table3_values():
    """The paper's Table 3, all twelve laws, against the L(C) values the design records and the ranges of a
    and b its text states."""
    assert set(PAPER_TABLE3) == {"llama", "tnl", "hgrn2", "cos2"}
    l_design = {"llama": (3.7087, -0.0798), "tnl": (3.5391, -0.0768), "hgrn2": (3.4788, -0.0753),
                "cos2": (3.5877, -0.0756)}
    for arch, laws in PAPER_TABLE3.items():
        assert laws["L"] == l_design[arch]
        assert 0.64 <= laws["N_opt"][1] <= 0.72 and 0.45 <= laws["D_opt"][1] <= 0.52
        ref = paper_reference(arch)
        assert ref["alpha"] == laws["L"][1] and "PFLOP-days" in ref["unit"] and "without the embedding" in ref["unit"]
    assert PAPER_TABLE3["llama"]["N_opt"] == (1.82e8, 0.7118) and PAPER_TABLE3["llama"]["D_opt"] == (2.56e10, 0.5102)
    assert paper_reference("mamba") == {}
    # the laws evaluated: coef * C^exponent as printed (LLaMA: L(1) = 3.7087, N_opt(10) = 1.82e8 * 10^0.7118)
    assert paper_law_at("llama", "L", 1.0) == 3.7087
    assert abs(paper_law_at("llama", "N_opt", 10.0) / (1.82e8 * 10 ** 0.7118) - 1) < 1e-12
    assert np.allclose(paper_law_at("tnl", "D_opt", np.array([1e-3, 1.0])),
                       [PAPER_TABLE3["tnl"]["D_opt"][0] * 1e-3 ** PAPER_TABLE3["tnl"]["D_opt"][1],
                        PAPER_TABLE3["tnl"]["D_opt"][0]])
    assert paper_law_at("mamba", "L", 1.0) is None


def test_cli_writes_table_json_and_plots(sweep, tmp_path, capsys):
    root, _ = sweep
    # a second arch with a single size: reported, not fatal
    write_run(root.parent / "single" / "llama-mini", model_config("llama", "mini"), LossLaw(), 1e8, n_rows=30)
    out, md = tmp_path / "fits.json", tmp_path / "table.md"
    rc = _cli()([str(root), str(root.parent / "single"), "--json", str(out), "--markdown", str(md),
                 "--plots", str(tmp_path / "plots"), "--n-boot", "0"])   # no intervals: NaN internally, null in JSON
    text = capsys.readouterr().out
    assert rc == 0
    assert "PFLOP-days" in text and "| tnl |" in text and ">= 2 sizes" in text
    assert "without the embedding term" in text.splitlines()[0]          # the C is named first thing
    rec = json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard JSON constant {c}"))
    tnl = rec["archs"]["tnl"]
    for key in ("alpha", "beta", "a", "b", "n_coef", "d_coef", "beta_flops", "eps_power_law", "paper", "handovers",
                "envelope_points_by_status", "warnings"):
        assert key in tnl
    assert tnl["paper"]["alpha"] == -0.0768 and "PFLOP-days" in tnl["paper"]["unit"]
    assert rec["include_embedding_flops"] is False and "PFLOP-days" in rec["units"]["C"]
    assert "without the embedding" in rec["compute"]
    # the FLOPs-unit coefficient predicts the same loss as the PFLOP-days one
    c_flops = 1e20
    assert tnl["beta_flops"] * c_flops ** tnl["alpha"] == pytest.approx(tnl["beta"] * (c_flops / 8.64e19) ** tnl["alpha"])
    assert "alpha" not in rec["archs"]["llama"]
    assert tnl["alpha_ci"] == [None, None]
    # Table 3 side by side: ours and the paper's L, N_opt and D_opt for the fitted architecture
    table = md.read_text()
    assert "Table 3 side by side" in table and "NOT like for like" not in table
    for law, (coef, exp) in PAPER_TABLE3["tnl"].items():
        row = [line for line in table.splitlines() if line.startswith(f"| tnl | {law}(C) |")]
        assert len(row) == 1 and f"{exp:.4f}" in row[0]
    pngs = sorted(p.name for p in (tmp_path / "plots").glob("*.png"))
    assert pngs == ["scaling_compare.png", "scaling_llama.png", "scaling_tnl.png"]
    assert all((tmp_path / "plots" / p).stat().st_size > 10_000 for p in pngs)
    # the other C is one flag away, and named as such
    assert _cli()([str(root), "--json", str(out), "--markdown", str(md), "--n-boot", "0", "--embedding-flops"]) == 0
    rec = json.loads(out.read_text())
    assert rec["include_embedding_flops"] is True and "including the embedding" in rec["compute"]
    assert "NOT like for like" in md.read_text()


def test_cli_chinchilla_gives_n_opt_and_d_opt_beside_the_paper(sweep, tmp_path, capsys):
    root, law = sweep
    out, md = tmp_path / "fits.json", tmp_path / "table.md"
    assert _cli()([str(root), "--json", str(out), "--markdown", str(md), "--n-boot", "0", "--chinchilla",
                   "--chinchilla-boot", "4"]) == 0
    al = json.loads(out.read_text())["archs"]["tnl"]["chinchilla"]["allocation"]
    assert al["ci_method"] == "runs-bootstrap" and al["n_replicates"] >= 1
    assert al["a_ci"][0] <= al["a"] <= al["a_ci"][1] or al["n_replicates"] < 4
    assert al["a"] == pytest.approx(law.a, abs=0.05) and al["b"] == pytest.approx(law.b, abs=0.05)
    # the FLOPs-unit coefficient gives the same N_opt as the PFLOP-days one
    assert al["n_coef_flops"] * 1e20 ** al["a"] == pytest.approx(al["n_coef"] * (1e20 / 8.64e19) ** al["a"])
    table = md.read_text()
    row = [line for line in table.splitlines() if line.startswith("| tnl | N_opt(C) approach 3 |")]
    assert len(row) == 1 and f"{al['a']:.4f}" in row[0] and f"{PAPER_TABLE3['tnl']['N_opt'][1]:.4f}" in row[0]
    row = [line for line in table.splitlines() if line.startswith("| tnl | approach 3 |")]
    assert len(row) == 1 and f"{al['b']:.3f}" in row[0] and f"{PAPER_TABLE3['tnl']['D_opt'][1]:.4f}" in row[0]
    assert any(line.startswith("| tnl | N_opt(C) handovers |") for line in table.splitlines())


def test_c_bounds_are_in_the_unit_the_tables_print(sweep, tmp_path, capsys):
    root, _ = sweep
    main = _cli()
    assert main([str(root), "--c-min", "1e20", "--n-boot", "0"]) == 2
    err = capsys.readouterr().err
    assert "PFLOP-days" in err and "--c-min 1.157" in err                 # the value it meant, converted
    out = tmp_path / "fits.json"
    assert main([str(root), "--c-min", "0.01", "--c-max", "10", "--n-boot", "0", "--json", str(out)]) == 0
    lo, hi = json.loads(out.read_text())["archs"]["tnl"]["fit_c_range_pflop_days"]
    assert 0.01 <= lo and hi <= 10
    assert main([str(root), "--c-min", "5", "--c-max", "1"]) == 2
    capsys.readouterr()
    # bounds past every run's C: the note names the bound and the runs' range, not the runs' overlap
    assert main([str(root), "--c-min", "1e6", "--n-boot", "0"]) == 1
    out = capsys.readouterr().out
    assert "--c-min 1e+06 leaves 0 envelope point(s): the runs span C =" in out
    # a context length no run was trained at
    assert main([str(root), "--seq-len", "12345"]) == 2
    assert "--seq-len 12345: no run was trained at that context length" in capsys.readouterr().err


def test_warmup_rows_are_warned_and_skipped_on_request(tmp_path, capsys):
    for size in ("mini", "70m", "160m"):
        write_run(tmp_path / f"tnl-{size}", model_config("tnl", size), LossLaw(), 3e9, n_rows=60, warmup_steps=10_000)
    main = _cli()
    assert main([str(tmp_path), "--n-boot", "0"]) == 0
    text = capsys.readouterr().out
    assert "WARNING rows inside the lr warm-up are fitted" in text and "--skip-warmup" in text
    # a --skip-tokens that stops short of the warm-up (1e9 tokens against the paper's 7.9e9) is named
    assert main([str(tmp_path), "--n-boot", "0", "--skip-tokens", "1000"]) == 0
    text = capsys.readouterr().out
    assert "WARNING --skip-tokens 1e+03 ends before the lr warm-up of 3 run(s)" in text
    assert main([str(tmp_path), "--n-boot", "0", "--skip-warmup"]) == 0
    text = capsys.readouterr().out
    assert "in the lr warm-up (--skip-warmup): 3" in text and "WARNING rows inside the lr warm-up" not in text


def test_cli_errors(tmp_path, capsys):
    main = _cli()
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty")]) == 2
    assert "no run directories" in capsys.readouterr().err
    write_run(tmp_path / "one" / "tnl-mini", model_config("tnl", "mini"), LossLaw(), 1e8, n_rows=30)
    assert main([str(tmp_path / "one")]) == 1
    captured = capsys.readouterr()
    assert ">= 2 sizes" in captured.out and "no architecture could be fitted" in captured.err


def test_runs_of_different_vocabularies_are_refused(tmp_path, capsys):
    """Loss per token depends on the tokenizer: 160m trained with a 32K vocabulary (its loss per token 15% lower)
    among 100K-vocabulary runs would win the envelope and move N_opt; the CLI names the runs and stops."""
    for size in ("70m", "160m", "410m"):
        cfg = model_config("tnl", size, **({"vocab_size": 32000} if size == "160m" else {}))
        law = LossLaw(E=1.8 * 0.85, A=40 * 0.85, B=845 * 0.85, alpha=0.2, beta=0.3236) if size == "160m" else LAW_618
        write_run(tmp_path / "runs" / f"tnl-{size}", cfg, law, 400 * paper_non_embedding_params(cfg))
    assert _cli()([str(tmp_path / "runs"), "--n-boot", "0"]) == 2
    err = capsys.readouterr().err
    assert "different vocabularies" in err and "vocab_size 32000: tnl-160m" in err and "tnl-410m" in err
    runs, _ = load_runs([tmp_path / "runs"])
    with pytest.raises(ValueError, match="different vocabularies"):
        analyze_arch("tnl", runs, FitSettings(n_boot=0))


def test_dense_logs_are_grouped_before_the_curve_fit(tmp_path):
    """A run logged at every step: its rows are averaged in bins of log D (at most MAX_CURVE_ROWS groups) before
    the learning-curve fit, which then still describes the rows it came from."""
    from scaling.optimal import MAX_CURVE_ROWS
    write_sweep(tmp_path, "tnl", ["70m", "160m", "410m"], LossLaw(), noise=0.01, n_rows=2500, early_rows=30)
    runs, _ = load_runs([tmp_path])
    res = analyze_arch("tnl", runs, FitSettings(n_boot=20))
    for sc, run in zip(res.curves, sorted(runs, key=lambda r: r.n_params)):
        assert len(run.tokens) > MAX_CURVE_ROWS and 100 < len(sc.log_d) <= MAX_CURVE_ROWS
        resid = np.log(run.loss) - sc.fit.log_loss(np.log(run.tokens))[0]
        assert abs(resid.mean()) < 2e-3 and resid.std() == pytest.approx(0.01, rel=0.1)   # just the noise
    assert len(res.optimal.used) == 2 and res.n_fit.n_replicates == 20
    from scaling.report import arch_record
    for rec, sc, run in zip(arch_record(res)["learning_curves"], res.curves, sorted(runs, key=lambda r: r.n_params)):
        assert rec["rows"] == len(run.tokens) and rec["fitted_points"] == len(sc.log_d) < rec["rows"]


def test_logging_every_step_from_the_first_does_not_bend_the_learning_curves(tmp_path):
    """Noise-free runs logged at every step from step 1 (more rows than MAX_CURVE_ROWS, most of them in the last
    decade of D): each size's fitted curve is the law's own section e = E + A/N^alpha, beta, and each handover is
    the law's crossing, as for the same runs logged every 100 steps. Averaging groups of equal row counts put
    steps 1..30 into one fitted row, decades wide, and moved the handovers by up to 6% in C."""
    from scipy.optimize import brentq
    law, sizes = LAW_618, ["70m", "160m", "410m"]
    for size in sizes:
        cfg = model_config("tnl", size)
        n = paper_non_embedding_params(cfg)
        batch = int(400 * n / 2048 / 3000)                  # ~3000 steps of 400·N tokens, every one logged
        write_run(tmp_path / size, cfg, law, 400 * n, global_batch=batch, n_rows=10 ** 6)
    runs, _ = load_runs([tmp_path])
    assert all(len(r.tokens) > 2500 and r.tokens[0] == r.tokens[1] / 2 for r in runs)
    res = analyze_arch("tnl", runs, FitSettings(n_boot=0))
    for sc in res.curves:
        assert float(sc.fit.e[0]) == pytest.approx(law.E + law.A / sc.n_params ** law.alpha, rel=1e-4)
        assert float(sc.fit.beta[0]) == pytest.approx(law.beta, abs=1e-3)
    assert len(res.optimal.used) == 2
    for h, small, large in zip(res.optimal.used, res.curves, res.curves[1:]):
        gap = lambda lc: (np.log(law(small.n_params, np.exp(lc) / small.flops_per_token))
                          - np.log(law(large.n_params, np.exp(lc) / large.flops_per_token)))
        lo, hi = max(small.log_c_range[0], large.log_c_range[0]), min(small.log_c_range[1], large.log_c_range[1])
        assert h.c == pytest.approx(np.exp(brentq(gap, lo, hi)), rel=1e-3)


@pytest.mark.parametrize("dense", [False, True])
def test_runs_of_one_size_weigh_alike_whatever_their_logging_interval(tmp_path, dense):
    """Two noise-free runs of 160m over the same tokens, one 2% above the law and one 2% below, logged at the
    same steps (two seeds of one schedule) or the second at every step (70x as often): the size's curve is the
    law's own, between the two. Before, rows at a token count another run had logged were dropped, and a dense
    run's rows crowded out the sparse one's, so the curve was whichever run came first or logged more."""
    law = LAW_618
    scaled = lambda k: LossLaw(E=law.E * k, A=law.A * k, B=law.B * k, alpha=law.alpha, beta=law.beta)   # noqa: E731
    for size in ("70m", "160m", "410m"):
        cfg = model_config("tnl", size)
        tokens = 400 * paper_non_embedding_params(cfg)
        if size != "160m":
            write_run(tmp_path / size, cfg, law, tokens)
            continue
        write_run(tmp_path / "160m-a", cfg, scaled(1.02), tokens, global_batch=800, n_rows=300)
        b = write_run(tmp_path / "160m-b", cfg, scaled(1 / 1.02), tokens, global_batch=800,
                      n_rows=10 ** 6 if dense else 300) / "metrics.jsonl"
        first = json.loads((tmp_path / "160m-a" / "metrics.jsonl").read_text().splitlines()[0])["tokens"]
        b.write_text("".join(ln + "\n" for ln in b.read_text().splitlines() if json.loads(ln)["tokens"] >= first))
    runs, _ = load_runs([tmp_path])
    res = analyze_arch("tnl", runs, FitSettings(n_boot=0))
    sc = res.curves[1]
    assert len(sc.runs[0].tokens) == 300 and len(sc.runs[1].tokens) == (21242 if dense else 300)
    assert float(sc.fit.e[0]) == pytest.approx(law.E + law.A / sc.n_params ** law.alpha, rel=1e-3)
    assert float(sc.fit.beta[0]) == pytest.approx(law.beta, abs=2e-3)


def test_a_size_whose_loss_does_not_fall_is_left_out(tmp_path):
    write_sweep(tmp_path, "hgrn2", ["70m", "160m", "410m"], LossLaw(), early_rows=30)
    bad = tmp_path / "hgrn2-160m" / "metrics.jsonl"
    rows = [json.loads(line) for line in bad.read_text().splitlines()]
    for i, r in enumerate(rows):
        r["loss"] = 3.0 + 1e-3 * i                    # diverging
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows))
    runs, _ = load_runs([tmp_path])
    res = analyze_arch("hgrn2", runs, FitSettings(n_boot=10))
    assert any("160m" in n and "no decreasing learning curve" in n for n in res.notes)
    assert [(h.small, h.large) for h in res.optimal.handovers] == [("70m", "410m")]


def test_adjacent_pairs_that_contradict_a_growing_n_opt_are_named():
    """Hand-made pair verdicts: a handover 2 -> 3 at C = 1 puts N_opt(1) above size 2, so size 1 still ahead of
    size 2 at C = 2 (N_opt(2) < size 2) contradicts it; the same verdict at C = 0.5, before the handover, does not."""
    from scaling.optimal import Handover, contradictions

    def pair(small, large, status, log_c_edge=float("nan"), c=float("nan")):
        n = {"s1": 10.0, "s2": 20.0, "s3": 40.0}
        return Handover(small=small, large=large, log_c=np.array([np.log(c)]), n=float(np.sqrt(n[small] * n[large])),
                        log_fpt=0.0, status=status, n_small=n[small], n_large=n[large], log_c_edge=log_c_edge)

    ho = pair("s2", "s3", "ok", c=1.0)
    late = pair("s1", "s2", "smaller_ahead", log_c_edge=np.log(2.0))
    early = pair("s1", "s2", "smaller_ahead", log_c_edge=np.log(0.5))
    assert late.n_opt_bound() == (pytest.approx(2.0), "<", 20.0) and ho.n_opt_bound() == (1.0, "≈", ho.n)
    found = contradictions([late, ho])
    assert len(found) == 1 and "s2 -> s3" in found[0] and "s1 -> s2" in found[0] and "N_opt > 20" in found[0]
    assert contradictions([early, ho]) == []
    # the larger size ahead from the start at C = 1 is a lower bound too
    ahead = pair("s2", "s3", "larger_ahead", log_c_edge=0.0)
    assert ahead.n_opt_bound() == (1.0, ">", 20.0) and len(contradictions([late, ahead])) == 1


def test_seeds_of_one_size_do_not_stretch_the_l_of_c_fit_range(tmp_path):
    """--min-runs counts model sizes: a second seed of the smallest size is not a competitor on the envelope, so
    the L(C) fit covers the C where two sizes are logged, as without the seed (counted as runs, the seed pulled
    in every point where only the smallest size was logged and moved the fitted exponent by ~15%)."""
    law = LossLaw()
    write_sweep(tmp_path / "runs", "tnl", ["70m", "160m", "410m"], law, noise=0.005, n_rows=40, seed=1,
                early_rows=20)
    settings = FitSettings(n_boot=0, points_per_decade=10)
    base = analyze_arch("tnl", load_runs([tmp_path / "runs"])[0], settings)
    cfg = model_config("tnl", "70m")
    write_run(tmp_path / "runs" / "tnl-70m-seed2", cfg, law, 400 * paper_non_embedding_params(cfg), noise=0.005,
              seed=77, n_rows=40, early_rows=20)
    runs, _ = load_runs([tmp_path / "runs"])
    res = analyze_arch("tnl", runs, settings)
    # the reference from the runs' logged C ranges alone: grid points inside the ranges of >= 2 distinct sizes
    c = res.envelope.c
    sizes_at = np.array([len({r.n_params for r in runs if r.compute[0] * (1 - 1e-9) <= x <= r.compute[-1] * (1 + 1e-9)})
                         for x in c])
    assert (sizes_at == 1).any() and (res.envelope.coverage[sizes_at == 1] == 2).any()   # seeds alone there
    np.testing.assert_array_equal(res.fit_mask, sizes_at >= 2)
    np.testing.assert_array_equal(res.fit_mask, base.fit_mask)
    assert res.loss_fit.exponent == pytest.approx(base.loss_fit.exponent, abs=0.002)


def test_analyze_arch_refuses_runs_of_another_architecture(tmp_path):
    """Runs of two architectures given to one analyze_arch call would enter one ladder (the 70m of each as two
    sizes, their 'handovers' between architectures); it names them instead. An alias names the same one."""
    for arch in ("tnl", "llama"):
        write_sweep(tmp_path / "runs", arch, ["70m", "160m"], LossLaw(), n_rows=20, early_rows=10)
    runs, _ = load_runs([tmp_path / "runs"])
    with pytest.raises(ValueError, match=r"other architectures \(llama: llama-160m \(llama\), llama-70m"):
        analyze_arch("tnl", runs, FitSettings(n_boot=0))
    tnl = [r for r in runs if r.arch == "tnl"]
    assert analyze_arch("TransNormer", tnl, FitSettings(n_boot=0)).arch == "tnl"


def test_chinchilla_max_tokens_that_leaves_no_size_is_named(tmp_path):
    """--chinchilla-max-tokens 20 (meant as 20B) leaves approach 3 no point: the note names the flag and its unit,
    not only the fit's "needs >= 2 model sizes; got 0"."""
    write_sweep(tmp_path / "runs", "tnl", ["70m", "160m", "410m"], LossLaw(), n_rows=20, early_rows=10)
    runs, _ = load_runs([tmp_path / "runs"])
    res = analyze_arch("tnl", runs, FitSettings(n_boot=0, chinchilla=True, chinchilla_boot=0,
                                                chinchilla_max_tokens=20))
    assert res.chinchilla is None
    note = next(n for n in res.notes if n.startswith("Chinchilla"))
    assert "--chinchilla-max-tokens 20 leaves 0 of" in note and "counts tokens" in note


def test_rerun_into_a_plots_folder_leaves_no_stale_figure(tmp_path, capsys, monkeypatch):
    """A second fit into the same --plots folder with fewer architectures, then with nothing fitted: the figures
    the earlier fits wrote and this one did not are gone (the comparison too), other files stay. (The drawing is
    stubbed: what is checked is which files the folder holds; test_cli_writes_table_json_and_plots draws.)"""
    import scaling.plots

    def stub(name):
        def draw(r, out, include_embedding, loss_key="loss"):
            path = out / (f"scaling_{r.arch}.png" if name == "arch" else "scaling_compare.png")
            path.write_bytes(b"png")
            return path
        return draw
    monkeypatch.setattr(scaling.plots, "plot_arch", stub("arch"))
    monkeypatch.setattr(scaling.plots, "plot_compare", stub("compare"))
    for arch in ("tnl", "llama"):
        write_sweep(tmp_path / "runs", arch, ["70m", "160m"], LossLaw(), n_rows=20, early_rows=10)
    plots = tmp_path / "plots"
    main = _cli()
    assert main([str(tmp_path / "runs"), "--n-boot", "0", "--plots", str(plots)]) == 0
    assert sorted(p.name for p in plots.iterdir()) == ["scaling_compare.png", "scaling_llama.png", "scaling_tnl.png"]
    (plots / "notes.txt").write_text("mine")
    assert main([str(tmp_path / "runs" / "tnl-70m"), str(tmp_path / "runs" / "tnl-160m"), "--n-boot", "0",
                 "--plots", str(plots)]) == 0
    assert sorted(p.name for p in plots.iterdir()) == ["notes.txt", "scaling_compare.png", "scaling_tnl.png"]
    assert main([str(tmp_path / "runs" / "tnl-70m"), "--n-boot", "0", "--plots", str(plots)]) == 1
    assert sorted(p.name for p in plots.iterdir()) == ["notes.txt", "scaling_tnl.png"]
    printed = [line.split("wrote ", 1)[1] for line in capsys.readouterr().out.splitlines() if line.startswith("wrote ")]
    assert printed[-1] == str(plots / "scaling_tnl.png")


def test_skip_tokens_below_one_step_is_warned_about_as_a_unit_slip(tmp_path):
    """--skip-tokens 7.9 (meant as the paper's 7.9B-token warm-up) drops nothing: the warning says it counts tokens.
    A cut of at least one step is a deliberate one and is not warned about."""
    write_sweep(tmp_path / "runs", "tnl", ["70m", "160m"], LossLaw(), n_rows=20)
    runs, _ = load_runs([tmp_path / "runs"])
    warn = load_launch_script("fit_scaling").skip_tokens_unit_warnings
    per_step = 2048 * 8    # write_run's seq_len x global_batch
    (w,) = warn(runs, 7.9)
    assert "--skip-tokens 7.9" in w and "not billions" in w and f"{per_step:.4g}" in w
    assert warn(runs, per_step) == [] and warn(runs, 0.0) == []


def test_points_per_decade_is_bounded(tmp_path, capsys):
    """--points-per-decade is at most 1,000 (0.23% steps in C): a denser grid adds nothing the fits use (at 100
    and 1,000 points per decade the L(C) exponent agrees to a small fraction of its interval) and costs memory per
    run and replicate, so a huge value made the fit exhaust the memory (a billion per decade: ~1e10 grid points).
    Past the bound: the usage error, saying why, before any run is read; the Python API refuses it too."""
    from scaling.envelope import MAX_POINTS_PER_DECADE, c_grid
    assert MAX_POINTS_PER_DECADE == 1000
    write_sweep(tmp_path / "runs", "tnl", ["tiny", "mini", "70m"], LossLaw(), tokens_per_param=300, n_rows=60,
                noise=0.01)
    runs, _ = load_runs([tmp_path / "runs"])
    fits = [analyze_arch("tnl", runs, FitSettings(n_boot=30, points_per_decade=p)).loss_fit for p in (100, 1000)]
    half_width = (fits[0].exponent_ci[1] - fits[0].exponent_ci[0]) / 2
    assert abs(fits[1].exponent - fits[0].exponent) < 0.05 * half_width, (fits, half_width)
    decades = np.log10(max(r.compute[-1] for r in runs) / min(r.compute[0] for r in runs))
    assert len(c_grid(runs, 1000)) == int(np.ceil(decades * 1000)) + 1
    for bad in (0, 1001, 10 ** 9):
        with pytest.raises(ValueError, match=r"points_per_decade .*: out of range; allowed: an integer from 1 to 1000 "
                                             r"\(a grid finer than 1000 points per decade"):
            c_grid(runs, bad)
    for flag in ("1001", "1000000000"):
        with pytest.raises(SystemExit) as exit_:
            _cli()([str(tmp_path / "nowhere"), "--points-per-decade", flag])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and f"argument --points-per-decade: {flag}: out of range; allowed: >= 1 and " \
            f"<= 1000: a grid finer than 1000 points per decade (0.23% steps in C) adds nothing the fits use" \
            in err, err
