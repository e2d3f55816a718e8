"""NIAH end to end: prompts, decoding on a tiny model, scoring, metrics and the heatmap."""
import re

import numpy as np
import pytest
import torch

from data_pipeline.tokenizer import EOT_ID, get_tokenizer
from evaluation import niah, scoring
from models import build_model


@pytest.fixture
def haystack(tmp_path):
    f = tmp_path / "hay.txt"
    f.write_text(" ".join(f"Sentence number {i} talks about rivers and hills." for i in range(400)))
    return [str(f)]


def test_prompt_has_exact_length_and_needle_at_token_depth(haystack):
    """The needle's tokens sit after exactly round(depth/100 · n_hay) haystack tokens (n_hay = what the
    prompt has room for), unsplit and unmoved, for depths that fall mid-sentence too; the achieved depth is
    reported and within half a token of the stated one."""
    tok = get_tokenizer()
    hay = niah.haystack_tokens(haystack, 600)
    needle = niah.Needle("qwerty", "7654321")
    for mode in ("standard", "easy"):
        n_text, q_text = needle.text(mode)
        n_ids, q_ids = tok.encode_ordinary(n_text), tok.encode_ordinary(q_text)
        for length in (300, 301):
            n_hay = length - 1 - len(n_ids) - len(q_ids)
            for depth in (0, 7.5, 25, 33, 50, 99, 100):
                info = {}
                p = niah.build_prompt(hay, needle, mode, length, depth, info)
                at = round(depth / 100 * n_hay)                   # reference: the stated token depth
                assert len(p) == length and p[0] == EOT_ID
                assert p[1:1 + at] == hay[:at]
                assert p[1 + at:1 + at + len(n_ids)] == n_ids
                assert p[1 + at + len(n_ids):length - len(q_ids)] == hay[at:n_hay]
                assert p[length - len(q_ids):] == q_ids
                assert info["needle_token"] == 1 + at
                assert info["achieved_depth"] == pytest.approx(100 * at / n_hay)
                assert abs(info["achieved_depth"] - depth) <= 50 / n_hay + 1e-9
            text = tok.decode(niah.build_prompt(hay, needle, mode, length, 100))
            assert text.endswith(n_text + q_text)                 # 100%: right before the question
            assert text.count("What is the special magic number for qwerty?") == (2 if mode == "easy" else 1)


def test_exact_scoring_by_default_partial_credit_on_request():
    value = "7654321"
    assert niah.score_reply(" 7654321.", value) == 10.0
    assert niah.score_reply(" 7654999 is it", value) == 1.0                         # 4 of 7 digits: a failure
    assert niah.score_reply(" 7654999", value, "partial") == pytest.approx(1 + 9 * 4 / 7)
    assert niah.score_reply(" 76543210", value, "partial") == pytest.approx(1 + 9 * 6 / 7)   # capped below 10
    assert niah.score_reply(" none", value, "partial") == 1.0
    # the trap the default avoids: with partial credit, 4 correct leading digits pass the default threshold
    assert niah.score_reply(" 7654999", value, "partial") >= niah.NiahConfig().threshold
    assert niah.NiahConfig().scoring == "exact"
    with pytest.raises(ValueError, match="scoring"):
        niah.score_reply("1", value, "lenient")


def test_unsorted_grids_are_refused(haystack, tmp_path):
    with pytest.raises(ValueError, match="strictly increasing"):
        niah.summarize(np.full((2, 2), 5.0), [50, 0], [100, 200])
    with pytest.raises(ValueError, match="strictly increasing"):
        niah.summarize(np.full((2, 2), 5.0), [0, 50], [200, 100])
    with pytest.raises(ValueError, match="strictly increasing"):
        niah.run_niah(None, niah.NiahConfig(lengths=(200, 200), depths=(0, 50), haystack=tuple(haystack)))
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        niah.run_niah(None, niah.NiahConfig(lengths=(200,), depths=(0, 150), haystack=tuple(haystack)))
    from evaluation import sweep as sw
    with pytest.raises(ValueError, match="strictly increasing"):
        sw.sweep(sw.SweepConfig(runs=[str(tmp_path)], tasks=["niah_easy"], niah_lengths=[2048, 1024]))


def test_niah_grid_with_oracle_reader(monkeypatch, haystack, tmp_path):
    """A reader that finds the needle only in the first half of the prompt: the grid, the scorer and the
    metrics must report exactly that pattern."""
    tok = get_tokenizer()

    def oracle(model, prompts, max_new_tokens, batch_size=8, eos_id=None, stop=None, **_):
        out = []
        for p in prompts:
            text = tok.decode(p)
            m = re.search(r"is (\d{7})\.", text)
            out.append(tok.encode_ordinary(f" {m.group(1)}." if m.start() < len(text) / 2 else " 42."))
        return out

    monkeypatch.setattr(scoring, "generate_tokens", oracle)
    cfg = niah.NiahConfig(lengths=(200, 400), depths=(0, 25, 75, 100), trials=2, haystack=tuple(haystack))
    res = niah.run_niah(None, cfg)
    expected = np.array([[10, 10], [10, 10], [1, 1], [1, 1]], dtype=float)
    assert np.array_equal(np.array(res["scores"]), expected)
    assert res["max_depth_error"] < 0.5 and all(abs(c["achieved_depth"] - c["depth"]) < 0.5 for c in res["cells"])
    m = res["metrics"]
    assert m["acc_avg"] == pytest.approx(0.5)
    assert m["penalty"] == {200: pytest.approx(2 ** -0.5), 400: pytest.approx(2 ** -0.5)}
    assert m == niah.summarize(expected, [0, 25, 75, 100], [200, 400])
    # same seed -> same needles
    assert [c["value"] for c in niah.run_niah(None, cfg)["cells"]] == [c["value"] for c in res["cells"]]
    png = niah.plot_heatmap(res, tmp_path / "h.png")
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("arch", ["llama", "tnl"])
def test_niah_end_to_end_tiny_model(arch, haystack, tmp_path):
    torch.manual_seed(0)
    model = build_model(arch, "tiny", max_seq_len=512).eval()
    cfg = niah.NiahConfig(mode="easy", lengths=(96, 160), depths=(0, 50, 100), max_new_tokens=3,
                          haystack=tuple(haystack), batch_size=2)
    res = niah.run_niah(model, cfg)
    s = np.array(res["scores"])
    assert s.shape == (3, 2) and ((s >= 1) & (s <= 10)).all()
    assert len(res["cells"]) == 6
    # each reply is what greedy decoding of that exact prompt produces
    tok = get_tokenizer()
    cell = res["cells"][4]
    hay = niah.haystack_tokens(list(haystack), max(cfg.lengths) + 997)
    prompt = niah.build_prompt(hay, niah.Needle(cell["key"], cell["value"]), "easy", cell["length"], cell["depth"])
    with torch.no_grad():
        ids = list(prompt)
        for _ in range(3):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert tok.decode(ids[len(prompt):]).startswith(cell["reply"])
    assert niah.plot_heatmap(res, tmp_path / "e2e.png").exists()


def test_half_the_trials_exact_is_a_success_whatever_their_order(monkeypatch, tmp_path):
    """Two cells with 5 of 10 trials exact (trials 0-4 in one, 0-2 and 6-7 in the other) both score exactly 5.5,
    the default threshold, so both succeed and the column's penalty is 1. A running sum of s/trials puts the
    first at 5.499999999999998 (a failure beside a success of the same count, penalty 2^-0.5)."""
    tok = get_tokenizer()
    f = tmp_path / "hay.txt"
    f.write_text(" ".join(f"Sentence number {i} talks about rivers and hills." for i in range(2000)))
    trials, length = 10, 200
    hay = niah.haystack_tokens([str(f)], length + 997 * trials)
    exact_trials = {10: {0, 1, 2, 3, 4}, 50: {0, 1, 2, 6, 7}}

    def reader(model, prompts, max_new_tokens, batch_size=8, eos_id=None, stop=None, **_):
        out = []
        for p in prompts:
            (t,) = [t for t in range(trials) if p[1:6] == hay[997 * t:997 * t + 5]]   # the trial's haystack offset
            text = tok.decode(p)
            m = re.search(r"is (\d{7})\.", text)
            depth = 10 if m.start() < 0.3 * len(text) else 50
            out.append(tok.encode_ordinary(f" {m.group(1)}." if t in exact_trials[depth] else " 42."))
        return out

    monkeypatch.setattr(scoring, "generate_tokens", reader)
    res = niah.run_niah(None, niah.NiahConfig(lengths=(length,), depths=(10, 50), trials=trials, haystack=(str(f),)))
    exact = {d: sorted(c["trial"] for c in res["cells"] if c["depth"] == d and c["exact"]) for d in (10, 50)}
    assert exact == {d: sorted(v) for d, v in exact_trials.items()}
    assert res["scores"] == [[5.5], [5.5]]
    assert res["metrics"]["penalty"] == {length: 1.0}
    assert res["metrics"]["niah_score"] == pytest.approx(0.5)   # a = 0.5 in every cell, p = 1
