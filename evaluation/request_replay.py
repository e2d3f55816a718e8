"""Log-likelihood tasks (the commonsense suite) split in three, for machines that cannot run lm-eval where
the model is:

1. `build_requests` (needs lm-eval, no model): lm-eval builds the tasks' requests and our tokenizer encodes
   them exactly as the `linscale` model would (TemplateLM's context/continuation split); the unique
   (context ids, continuation ids) pairs are written to one JSON file.
2. `score_requests` (needs the model, not lm-eval): `evaluation.scoring.score_continuations` on every pair,
   the function the `linscale` model itself calls, with the same scoring window.
3. `replay` (needs lm-eval, no model): lm-eval runs the tasks again with a model that answers every request
   from the stored scores, so documents, gold labels, metrics and aggregation are lm-eval's own and the
   numbers equal a direct run (tests/test_study_replay.py checks this on all commonsense tasks).

The request file depends only on the tasks, the limit and the tokenizer, so one file serves every snapshot
of a study; scores are a few floats per request.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

FORMAT = "linscale-lm-requests-1"


def _lm_base():
    """LinscaleLM's tokenizer side (tok_encode, eot, prefix token) without a model behind it."""
    from evaluation.lm_eval_adapter import LinscaleLM
    from lm_eval.api.model import TemplateLM

    from data_pipeline.tokenizer import get_tokenizer

    class _TokenOnlyLM(LinscaleLM):
        def __init__(self, max_length: int = 8192):
            TemplateLM.__init__(self)
            self.model = None
            self.pretrained = None
            self.batch_size_per_gpu = 1
            self._max_length = max_length
            self.max_gen_toks = 0
            self.tokenizer_obj = get_tokenizer()

        @property
        def device(self):
            return "cpu"

        def get_model_info(self) -> dict:
            return {"linscale_request_replay": True}

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("request replay covers log-likelihood (multiple-choice) tasks only")

        def generate_until(self, requests, disable_tqdm: bool = False):
            raise NotImplementedError("request replay covers log-likelihood (multiple-choice) tasks only")

    return _TokenOnlyLM


def _key(ctx, cont) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(int(t) for t in ctx), tuple(int(t) for t in cont)


def _sweep_config(limit: int | None, batch_size: int = 8):
    from evaluation.sweep import SweepConfig
    return SweepConfig(runs=[], limit=limit, batch_size=batch_size)


def build_requests(tasks: list[str], limit: int | None) -> dict:
    """{"format", "tasks", "limit", "pairs": [[context ids, continuation ids], ...], "sha256"} for the
    commonsense `tasks` (names as in evaluation.sweep.CSR_TASKS) at `limit` examples per task."""
    from evaluation.sweep import CSR_TASKS, run_lm_eval
    bad = [t for t in tasks if t not in CSR_TASKS]
    if bad:
        raise ValueError(f"request replay supports the commonsense tasks {', '.join(CSR_TASKS)}; not {bad}")

    class RecordingLM(_lm_base()):
        def __init__(self):
            super().__init__()
            self.pairs: dict = {}

        def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs):
            from evaluation.lm_eval_adapter import request_label
            items = getattr(self, "_items", None) or [(None, None)] * len(requests)
            for i, ((_, ctx, cont), (task, doc)) in enumerate(zip(requests, items)):
                # a pair shared by several items is named by the first
                self.pairs.setdefault(_key(ctx, cont), request_label(task, doc, i))
            return [(0.0, False)] * len(requests)

    lm = RecordingLM()
    run_lm_eval(None, list(tasks), _sweep_config(limit), lm=lm, task_manager=task_manager())
    pairs = [[list(c), list(k)] for c, k in lm.pairs]
    digest = hashlib.sha256(json.dumps([list(tasks), limit, pairs]).encode()).hexdigest()
    # items: the task and item of each pair, for errors only (not part of the digest)
    return {"format": FORMAT, "tasks": list(tasks), "limit": limit, "pairs": pairs, "sha256": digest,
            "items": list(lm.pairs.values())}


def write_requests(path: str | Path, tasks: list[str], limit: int | None) -> dict:
    req = build_requests(tasks, limit)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(req))
    tmp.rename(path)
    return req


def read_requests(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no request file; build it where lm-eval is installed "
                                f"(evaluation.request_replay.write_requests, or launch/study.py plan)")
    req = json.loads(path.read_text())
    if req.get("format") != FORMAT:
        raise ValueError(f"{path}: not a request file of format {FORMAT}")
    return req


def score_requests(model, requests: dict, max_length: int | None = None, batch_size: int = 8) -> list[list]:
    """[log-likelihood, is_greedy] of every pair, scored as the `linscale` lm-eval model scores it
    (max_length: the scoring window; default the model config's max_seq_len, as LinscaleLM)."""
    from evaluation.scoring import score_continuations
    window = max_length or model.config.max_seq_len
    labels = requests.get("items")
    if not (isinstance(labels, list) and len(labels) == len(requests["pairs"])):
        labels = None   # a file written before the items were recorded: requests are named by index
    res = score_continuations(model, [(c, k) for c, k in requests["pairs"]], window, batch_size, labels=labels)
    return [[float(ll), bool(g)] for ll, g in res]


def task_manager():
    """lm-eval's TaskManager over our task folder only (indexing lm-eval's own ~10k task files takes about a
    minute and the local commonsense tasks need none of them), keeping the tasks it builds: replaying many
    snapshots builds each task's documents once."""
    from lm_eval.tasks import TaskManager

    from evaluation.lm_eval_adapter import tasks_dir

    class KeepingTaskManager(TaskManager):
        def __init__(self):
            super().__init__(include_path=str(tasks_dir()), include_defaults=False)
            self._built: dict = {}

        def load_task_or_group(self, task_list):
            key = json.dumps(task_list, sort_keys=True, default=str)
            if key not in self._built:
                self._built[key] = super().load_task_or_group(task_list)
            return self._built[key]

    return KeepingTaskManager()


def replay(requests: dict, scores: list, limit: int | None = None, manager=None,
           max_length: int | None = None) -> dict[str, dict]:
    """The metrics of each task (as evaluation.sweep.run_lm_eval reports them) from stored scores.
    `manager`: a task_manager() shared by many replays of the same request file. `max_length`: the window the
    scores were made in; given, each task also reports `truncated` (its items whose context was cut to fit), as a
    direct run does."""
    from evaluation.sweep import run_lm_eval
    if len(scores) != len(requests["pairs"]):
        raise ValueError(f"{len(scores)} scores for {len(requests['pairs'])} requests: the scores belong to "
                         f"another request file")
    if limit is not None and limit != requests["limit"]:
        raise ValueError(f"limit {limit} differs from the request file's {requests['limit']}")
    table = {_key(c, k): (float(s[0]), bool(s[1])) for (c, k), s in zip(requests["pairs"], scores)}

    class ReplayLM(_lm_base()):
        def __init__(self):
            super().__init__(max_length or 8192)
            self.truncated = {} if max_length else None

        def _loglikelihood_tokens(self, reqs, disable_tqdm: bool = False, **kwargs):
            if max_length:
                items = getattr(self, "_items", None) or [(None, None)] * len(reqs)
                self.count_truncated([(ctx, cont) for _, ctx, cont in reqs], items)
            out = []
            for _, ctx, cont in reqs:
                k = _key(ctx, cont)
                if k not in table:
                    raise KeyError("a request is missing from the stored scores: the request file was built "
                                   "with other tasks, limit, tokenizer or lm-eval version")
                out.append(table[k])
            return out

    return run_lm_eval(None, list(requests["tasks"]), _sweep_config(requests["limit"]), lm=ReplayLM(),
                       task_manager=manager or task_manager())
