"""Evaluation metric functions against hand-computed cases and lm-eval's own helpers."""
import re

import numpy as np
import pytest

from evaluation import niah
from evaluation.scoring import rolling_windows

DEPTHS, LENGTHS = [0, 50, 100], [1000, 2000]


def test_penalty_cases():
    assert niah.column_penalty([True, True, True]) == 1.0          # all succeed
    assert niah.column_penalty([False, False, False]) == 0.0       # none
    assert niah.column_penalty([True, False, False]) == pytest.approx(2 ** -0.5)   # n = 2 runs
    assert niah.column_penalty([True, False, True]) == pytest.approx(2 ** -1.0)    # n = 3
    assert niah.column_penalty([False, True, False, True]) == pytest.approx(2 ** -1.5)  # n = 4
    assert niah.runs_down([1, 1, 0, 0, 1]) == 3


def test_summarize_hand_computed():
    # scores[depth, length]; a = (s-1)/9
    s = np.array([[10.0, 10.0],
                  [10.0, 1.0],
                  [5.5, 10.0]])
    a = (s - 1) / 9  # [[1,1],[1,0],[.5,1]]
    m = niah.summarize(s, DEPTHS, LENGTHS, alpha_d=2.0, alpha_c=3.0, threshold=5.5)
    assert m["acc_at_length"] == {1000: pytest.approx(2.5 / 3), 2000: pytest.approx(2 / 3)}
    assert m["acc_upto_length"] == {1000: pytest.approx(2.5 / 3), 2000: pytest.approx(4.5 / 6)}
    assert m["acc_avg"] == pytest.approx(4.5 / 6)
    # W = outer([1,2,4], [1,3]) = [[1,3],[2,6],[4,12]], ΣW = 28
    wa = 1 * 1 + 3 * 1 + 2 * 1 + 6 * 0 + 4 * 0.5 + 12 * 1
    assert m["weighted_avg_acc"] == pytest.approx(wa / 28)
    # column 0: s>=5.5 -> [T,T,T] p=1; column 1: [T,F,T] -> 3 runs, p=2^-1
    assert m["penalty"] == {1000: 1.0, 2000: pytest.approx(0.5)}
    score = (1 * 1 + 2 * 1 + 4 * 0.5) * 1 + (3 * 1 + 6 * 0 + 12 * 1) * 0.5
    assert m["niah_score"] == pytest.approx(score / 28)
    assert np.allclose(a, [[1, 1], [1, 0], [0.5, 1]])


def test_summarize_extremes_and_validation():
    ones = np.full((3, 2), 10.0)
    m = niah.summarize(ones, DEPTHS, LENGTHS)
    assert m["acc_avg"] == m["weighted_avg_acc"] == m["niah_score"] == 1.0
    m = niah.summarize(np.ones((3, 2)), DEPTHS, LENGTHS)
    assert m["acc_avg"] == m["niah_score"] == 0.0
    with pytest.raises(ValueError):
        niah.summarize(np.ones((2, 2)), DEPTHS, LENGTHS)
    with pytest.raises(ValueError):
        niah.summarize(ones, DEPTHS, LENGTHS, alpha_d=1.0)


def test_score_reply():
    # the default rule: the exact value or nothing
    assert niah.score_reply(" 1234567.", "1234567") == 10.0
    assert niah.score_reply(" nothing", "1234567") == 1.0
    assert niah.score_reply(" 1239999", "1234567") == 1.0
    assert niah.score_reply(" 12345678", "1234567") == 1.0                           # longer is not exact
    # partial credit per correct leading digit, on request
    assert niah.score_reply(" 1234567.", "1234567", "partial") == 10.0
    assert niah.score_reply(" 1239999", "1234567", "partial") == pytest.approx(1 + 9 * 3 / 7)
    assert niah.score_reply(" 12345678", "1234567", "partial") == pytest.approx(1 + 9 * 6 / 7)
    assert niah.score_reply(" 7654321", "1234567", "partial") == 1.0


@pytest.mark.parametrize("n_tokens,max_len", [(1, 4), (4, 4), (5, 4), (11, 4), (23, 7)])
def test_rolling_windows_match_lm_eval(n_tokens, max_len):
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
    toks = list(range(100, 100 + n_tokens))
    ref = [make_disjoint_window(w) for w in get_rolling_token_windows(toks, 0, max_len, 1)]
    ours = rolling_windows(toks, 0, max_len)
    assert [(list(a), list(b)) for a, b in ref] == ours
    assert sum(len(b) for _, b in ours) == n_tokens
    assert all(len(a) + len(b) <= max_len + 1 for a, b in ours)


def test_encode_pair_matches_lm_eval_split():
    from evaluation.lm_eval_adapter import LinscaleLM
    from evaluation.perplexity import encode_pair
    lm = LinscaleLM.__new__(LinscaleLM)  # only the tokenizer is needed for TemplateLM._encode_pair
    from data_pipeline.tokenizer import EOT_ID, get_tokenizer
    lm.tokenizer_obj = get_tokenizer()
    for ctx, cont in [("The cat sat on the", " mat"), ("Ends with space ", "word"), ("a", "bc"), ("", "hello")]:
        if ctx:
            assert encode_pair(ctx, cont) == tuple(lm._encode_pair(ctx, cont))
        else:  # empty context: <|endoftext|> conditions the continuation, as lm-eval's prefix token
            assert encode_pair(ctx, cont) == ([EOT_ID], lm.tokenizer_obj.encode_ordinary(cont))


def test_wikitext_documents_and_word_count(shared_data, tmp_path):
    from evaluation.local_data import eval_path, wikitext_documents
    from evaluation.perplexity import word_count
    pages = wikitext_documents(eval_path("wikitext2_test", shared_data / "eval"))
    assert len(pages) == 62  # EleutherAI/wikitext_document_level, wikitext-2-raw-v1 test
    assert pages[0].startswith(" = Robert Boulter = \n")
    raw = (shared_data / "eval/wikitext-2-raw/wiki.test.raw").read_text()
    assert raw.startswith(" \n") and "\n".join(pages) == raw[2:]  # only the blank line before page 1 is dropped
    # a user file: sub-headings (= = x = =) do not start a page
    f = tmp_path / "w.raw"
    f.write_text(" \n = A = \n \n x y \n = = Sub = = \n z \n = B = \n w \n")
    assert wikitext_documents(f) == [" = A = \n \n x y \n = = Sub = = \n z ", " = B = \n w \n"]
    assert word_count(" a b \n c ") == len(re.split(r"\s+", " a b \n c ")) == 5
    assert word_count("x") == 1


def test_a_continuation_is_scored_whole_or_refused():
    """score_continuations sums the log-probabilities of every continuation token: a continuation that fills
    the window exactly is scored whole (against a direct forward pass); one longer than the window, or one
    without a context token before it, would be scored in part, so it is refused."""
    import torch

    from evaluation.scoring import score_continuations
    from models import build_model
    torch.manual_seed(0)
    model = build_model("tnl", "tiny", vocab_size=300).eval()
    ctx, cont = [5, 17, 42], [7, 99, 3, 250]
    (got, _), = score_continuations(model, [(ctx, cont)], max_length=4)
    ids = torch.tensor([(ctx + cont)[-5:-1]])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids)[0].double(), -1)
    want = sum(float(logp[j, t]) for j, t in enumerate(cont))
    assert abs(got - want) < 1e-4, (got, want)
    with pytest.raises(ValueError, match="longer than the scoring window max_length 3"):
        score_continuations(model, [(ctx, cont)], max_length=3)
    with pytest.raises(ValueError, match="no context"):
        score_continuations(model, [([], cont)], max_length=16)
