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


def test_prompt_has_exact_length_and_needle_at_depth(haystack):
    tok = get_tokenizer()
    hay = niah.haystack_tokens(haystack, 600)
    needle = niah.Needle("qwerty", "7654321")
    for mode in ("standard", "easy"):
        for depth in (0, 25, 50, 100):
            p = niah.build_prompt(hay, needle, mode, 300, depth)
            assert len(p) == 300 and p[0] == EOT_ID
            text = tok.decode(p)
            assert text.endswith("The special magic number for qwerty is")
            at = text.index("7654321")
            frac = at / len(text)
            assert abs(frac - depth / 100) < 0.12, (mode, depth, frac)
            if mode == "easy":
                assert text.count("What is the special magic number for qwerty?") == 2
            else:
                assert text.count("What is the special magic number for qwerty?") == 1


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
