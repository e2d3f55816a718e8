"""Commonsense metrics from stored scores (evaluation.request_replay) equal a direct lm-eval run of the same
model: requests recorded without a model, scored by the model alone, replayed through lm-eval."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("lm_eval")

# a yes/no task, WinoGrande (one request per filled-in option: several contexts, one continuation), and two
# with acc_norm; the other commonsense tasks go through the same code (HellaSwag's preprocessing is slow)
TASKS = ["boolq", "winogrande", "arc_challenge", "piqa"]


def _model(seed: int):
    from models import build_model
    torch.manual_seed(seed)
    return build_model("hgrn2", "tiny", max_seq_len=256).eval()


def test_replayed_metrics_equal_direct_lm_eval_runs(shared_data, monkeypatch):
    from evaluation.request_replay import build_requests, replay, score_requests, task_manager
    from evaluation.sweep import SweepConfig, run_lm_eval
    monkeypatch.setenv("LINSCALE_SHARED_DATA", str(shared_data))
    limit = 6
    req = build_requests(TASKS, limit)
    assert req["tasks"] == TASKS and req["limit"] == limit
    # one request per choice of every item (BoolQ, WinoGrande, PIQA 2, ARC 3-5), a few shared between items
    assert 2 * limit * len(TASKS) * 0.8 <= len(req["pairs"]) <= 5 * limit * len(TASKS)
    assert all(cont and all(isinstance(t, int) for t in ctx + cont) for ctx, cont in req["pairs"])
    manager = task_manager()
    for seed in (0, 1):  # two models through one task manager: built tasks are reused correctly
        model = _model(seed)
        direct = run_lm_eval(model, TASKS, SweepConfig(runs=[], limit=limit, batch_size=4, max_length=256),
                             task_manager=manager)
        scores = score_requests(model, req, max_length=256, batch_size=4)
        # given the window the scores were made in, the replay counts the items whose context was cut, as the
        # direct run does (BoolQ's passages are longer than 256 tokens)
        replayed = replay(req, scores, manager=manager, max_length=256)
        assert set(replayed) == set(direct) == set(TASKS)
        assert direct["boolq"]["truncated"] > 0 and all("truncated" in direct[t] for t in TASKS)
        for t in TASKS:
            assert set(replayed[t]) == set(direct[t]), t
            for metric, v in direct[t].items():
                assert replayed[t][metric] == pytest.approx(v, abs=1e-12), (seed, t, metric)


def test_replay_refuses_scores_of_another_request_file(shared_data, monkeypatch):
    from evaluation.request_replay import build_requests, replay
    monkeypatch.setenv("LINSCALE_SHARED_DATA", str(shared_data))
    req = build_requests(["piqa"], 2)
    with pytest.raises(ValueError, match="another request file"):
        replay(req, [[0.0, False]] * (len(req["pairs"]) + 1))
    wrong = {**req, "pairs": [[c, k + [1]] for c, k in req["pairs"]]}
    with pytest.raises(KeyError, match="missing from the stored scores"):
        replay(wrong, [[0.0, False]] * len(req["pairs"]))
    with pytest.raises(ValueError, match="commonsense tasks"):
        build_requests(["wikitext2"], 2)
