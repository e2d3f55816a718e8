"""Perplexity and scoring against values computed by hand from tiny stand-in models whose log-probabilities
are known in closed form: every token is counted once, over documents and windows, and ratios are sums of
log-likelihoods over sums of counts (not means of per-document perplexities)."""
import math

import pytest
import torch

from evaluation import perplexity, scoring

V = 5


class Bigram(torch.nn.Module):
    """p(next | prefix) depends only on the last token: log p(b | a) = log_softmax(W[a])[b]. Token ids are
    taken mod V, so <|endoftext|> (the prefix token) is a valid input too."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.W = torch.nn.Parameter(torch.randn(V, V, generator=g, dtype=torch.float64))

    def hidden_states(self, ids, cache=None):
        return torch.nn.functional.one_hot(ids % V, V).double()

    def logits(self, h):
        return h @ self.W

    def lp(self, a: int, b: int) -> float:
        return float(torch.log_softmax(self.W.detach()[a % V], -1)[b % V])


class Mean(Bigram):
    """The hidden state at t is the mean one-hot of the window's tokens 0..t: depends on how the window is cut."""

    def hidden_states(self, ids, cache=None):
        oh = torch.nn.functional.one_hot(ids % V, V).double()
        return oh.cumsum(1) / torch.arange(1, ids.shape[1] + 1, dtype=torch.float64)[None, :, None]


def doc_ll(m: Bigram, prefix: int, toks: list[int]) -> float:
    """Every token once, the first conditioned on the prefix token."""
    return sum(m.lp(a, b) for a, b in zip([prefix] + toks[:-1], toks))


DOCS = [[1, 2, 3, 4, 0, 1, 2], [3], [2, 2, 2, 2], [], [4, 3, 2, 1, 0, 1, 2, 3, 4, 0, 1]]


@pytest.mark.parametrize("max_length", [1, 2, 3, 4, 7, 11, 12, 50])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_rolling_loglikelihood_counts_every_token_once(max_length, batch_size):
    # a bigram model's document log-likelihood does not depend on the windows, provided each token is predicted
    # exactly once from its true predecessor (the first from the prefix): any dropped, doubled or mis-aligned
    # token in the windows changes the sum
    m = Bigram()
    got = scoring.rolling_loglikelihood(m, DOCS, 0, max_length, batch_size)
    assert got == pytest.approx([doc_ll(m, 0, d) for d in DOCS], abs=1e-4)
    assert got[3] == 0.0   # an empty document: no token, no log-likelihood


@pytest.mark.parametrize("max_length", [2, 3, 5, 30])
def test_score_continuations_truncates_context_from_the_left(max_length):
    # the last max_length+1 tokens of context+continuation, minus the final one, are the input; rows of
    # different lengths share a right-padded batch
    m = Mean()
    reqs = [([1, 2], [3, 4]), ([4], [0]), ([1, 2, 3, 4, 0, 1, 2, 3], [4, 0]), ([2] * 9, [1])]

    def by_hand(ctx, cont):
        whole = (ctx + cont)[-(max_length + 1):]
        total = 0.0
        for k in range(len(whole) - len(cont), len(whole)):
            seen = whole[:k]   # the window's tokens before the target
            h = torch.tensor([seen.count(v) for v in range(V)], dtype=torch.float64) / len(seen)
            total += float(torch.log_softmax(h @ m.W.detach(), -1)[whole[k]])
        return total

    out = scoring.score_continuations(m, reqs, max_length, batch_size=3)
    assert [s for s, _ in out] == pytest.approx([by_hand(c, t) for c, t in reqs], abs=1e-4)


def test_validation_loss_weights_tokens_not_windows():
    m = Bigram()
    wins = [[1, 2, 3, 4], [4, 0], [0, 1, 2], [3]]   # 3 + 1 + 2 targets; the 1-token window has none
    nll = -sum(m.lp(a, b) for w in wins for a, b in zip(w[:-1], w[1:]))
    res = scoring.validation_loss(m, [torch.tensor(w) for w in wins], batch_size=2)
    assert res["tokens"] == 6 and res["windows"] == 3
    assert res["loss"] == pytest.approx(nll / 6, abs=1e-5)
    assert res["perplexity"] == pytest.approx(math.exp(nll / 6), rel=1e-5)
    # not the mean of per-window losses (3, 1 and 2 targets weigh 3:1:2)
    per_window = [-sum(m.lp(a, b) for a, b in zip(w[:-1], w[1:])) / (len(w) - 1) for w in wins[:3]]
    assert res["loss"] != pytest.approx(sum(per_window) / 3, abs=1e-6)


class _Tok:
    name = "stub"

    def encode_ordinary(self, text):
        return [int(c) for c in text if c.isdigit()]


def test_wikitext_perplexity_sums_over_documents(monkeypatch):
    # two pages: the ratios are Σ ll / Σ words (bytes), lm-eval's weighted perplexity, not means of per-page ones
    pages = ["1", " 3 0 3 0 3 0 3 0 3 0 "]
    m = Bigram()
    monkeypatch.setattr(perplexity.local_data, "wikitext_documents", lambda path=None: list(pages))
    monkeypatch.setattr(perplexity, "get_tokenizer", lambda: _Tok())
    monkeypatch.setattr(perplexity, "wikitext_detokenizer", lambda page: page)
    toks = [_Tok().encode_ordinary(p) for p in pages]
    eot = perplexity.EOT_ID
    ll = [doc_ll(m, eot, t) for t in toks]
    words = [1, 12]   # re.split(r"\s+"): the second page's leading and trailing blanks add two empty strings
    nbytes = [1, 21]
    res = perplexity.wikitext_perplexity(m, max_length=3, batch_size=2)
    assert res["words"] == sum(words) and res["bytes"] == sum(nbytes) and res["tokens"] == 11
    assert res["loglikelihood"] == pytest.approx(sum(ll), abs=1e-4)
    assert res["word_perplexity"] == pytest.approx(math.exp(-sum(ll) / sum(words)), rel=1e-5)
    assert res["byte_perplexity"] == pytest.approx(math.exp(-sum(ll) / sum(nbytes)), rel=1e-5)
    assert res["bits_per_byte"] == pytest.approx(-sum(ll) / sum(nbytes) / math.log(2), rel=1e-5)
    mean_of_pages = sum(math.exp(-a / w) for a, w in zip(ll, words)) / 2
    assert res["word_perplexity"] != pytest.approx(mean_of_pages, rel=0.05)


def test_scrolls_score_is_the_benchmarks_per_task_score():
    """SCROLLS reports F1 for Qasper and NarrativeQA, exact match for QuALITY and ContractNLI, and for the
    summarization tasks the geometric mean of ROUGE-1, ROUGE-2 and ROUGE-L (hand-computed here)."""
    from evaluation.sweep import scrolls_score
    got = scrolls_score("scrolls_govreport", {"rouge1": 40.0, "rouge2": 10.0, "rougeL": 20.0})
    assert abs(got["rouge_gm"] - 20.0) < 1e-12 and got["scrolls"] == got["rouge_gm"]   # (40*10*20)^(1/3) = 20
    got = scrolls_score("scrolls_qmsum", {"rouge1": 27.0, "rouge2": 1.0, "rougeL": 8.0})
    assert abs(got["scrolls"] - 6.0) < 1e-12                                           # 216^(1/3) = 6
    assert scrolls_score("scrolls_summscreenfd", {"rouge1": 30.0, "rouge2": 0.0, "rougeL": 20.0})["scrolls"] == 0.0
    assert scrolls_score("scrolls_govreport", {"rouge1": 30.0, "rougeL": 20.0}) == {}   # ROUGE-2 missing
    assert scrolls_score("scrolls_qasper", {"f1": 31.5, "em": 9.0}) == {"scrolls": 31.5}
    assert scrolls_score("scrolls_quality", {"em": 40.0, "acc": 41.0}) == {"scrolls": 40.0}
    assert scrolls_score("scrolls_contractnli", {"acc": 70.0}) == {}
