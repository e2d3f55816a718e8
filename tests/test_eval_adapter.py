"""The lm-eval adapter and the perplexity functions against a direct forward pass of the model."""
import json
import math

import pytest
import torch

import evaluation  # noqa: F401  (registers "linscale")
from data_pipeline.tokenizer import EOT_ID, get_tokenizer
from evaluation.lm_eval_adapter import LinscaleLM
from evaluation.perplexity import encode_pair
from eval_utils import write_tiny_mc_task
from models import build_model, save_pretrained

ARCHS = ["llama", "tnl", "hgrn2", "cos2"]


class Req:  # the part of lm_eval.api.instance.Instance the adapter reads
    def __init__(self, *args):
        self.args = args


@pytest.fixture(scope="module")
def models():
    out = {}
    for arch in ARCHS:
        torch.manual_seed(1)
        out[arch] = build_model(arch, "tiny", max_seq_len=64).eval()
    return out


def direct_logprob(model, ctx, cont, max_length):
    """Sum of log p(cont | ctx) from one unbatched full forward pass (the reference)."""
    ids = (ctx + cont)[-(max_length + 1):]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).double(), -1)[0]
    n = min(len(cont), len(ids) - 1)
    tgt = ids[-n:]
    pos = range(len(ids) - 1 - n, len(ids) - 1)
    lp = sum(float(logp[p, t]) for p, t in zip(pos, tgt))
    greedy = all(int(logp[p].argmax()) == t for p, t in zip(pos, tgt))
    return lp, greedy


@pytest.mark.parametrize("arch", ARCHS)
def test_loglikelihood_equals_forward_pass(models, arch):
    model = models[arch]
    lm = LinscaleLM(model=model, batch_size=3, max_length=40)
    tok = get_tokenizer()
    pairs = [("The quick brown fox", " jumps over the lazy dog"), ("", "Hello world"),
             ("One two three four five six", " seven"),
             ("A much longer context " * 8, " that gets truncated on the left")]  # > max_length tokens
    got = lm.loglikelihood([Req(c, t) for c, t in pairs], disable_tqdm=True)
    for (c, t), (lp, greedy) in zip(pairs, got):
        ce, te = encode_pair(c, t)  # lm-eval's context/continuation split (checked in test_eval_metrics)
        ref_lp, ref_greedy = direct_logprob(model, ce, te, 40)
        assert lp == pytest.approx(ref_lp, rel=1e-4, abs=1e-3)
        assert greedy == ref_greedy
    # the rolling log-likelihood covers every token of the document exactly once
    text = "Rolling windows over a document that is longer than the window. " * 4
    (rolled,) = lm.loglikelihood_rolling([Req(text)], disable_tqdm=True)
    ids = tok.encode_ordinary(text)
    ref = 0.0
    for start in range(0, len(ids), 40):
        end = min(start + 40, len(ids))
        ctx = [EOT_ID] if start == 0 else ids[max(0, end - 41):start]
        ref += direct_logprob(model, ctx, ids[start:end], 40)[0]
    assert rolled == pytest.approx(ref, rel=1e-4)


@pytest.mark.parametrize("arch", ["llama", "hgrn2"])
def test_generate_until_matches_greedy_recompute(models, arch):
    model = models[arch]
    lm = LinscaleLM(model=model, batch_size=4, max_length=64)
    tok = get_tokenizer()
    prompts = ["Once upon a time", "Once upon a date", "In the beginning there was"]
    refs = []
    for p in prompts:  # greedy decoding by recomputing the whole sequence each step (no cache)
        ids = tok.encode_ordinary(p)
        new = []
        with torch.no_grad():
            for _ in range(8):
                new.append(int(model(torch.tensor([ids + new]))[0, -1].argmax()))
        refs.append(tok.decode(new))
    out = lm.generate_until([Req(p, {"until": ["\n\n\n\n"], "max_gen_toks": 8}) for p in prompts], disable_tqdm=True)
    assert out == [r.split("\n\n\n\n")[0] for r in refs]
    until = refs[0][3:6] or refs[0][-1]
    out = lm.generate_until([Req(prompts[0], {"until": [until], "max_gen_toks": 8})], disable_tqdm=True)
    assert out == [refs[0].split(until)[0]]


def test_generate_until_takes_lm_evals_budget_names_and_skips_empty_stops(models):
    """lm-eval gives the generation budget under any of four names (max_gen_toks > max_new_tokens > max_tokens >
    max_completion_tokens, lm_eval.models.utils.normalize_gen_kwargs): each is obeyed, in that priority, not
    replaced by the model's 256. An empty `until` string (a --gen_kwargs slip) stops nothing and cuts nothing,
    as lm-eval's post-processing skips it. Reference: greedy decoding by full recomputation."""
    model = models["hgrn2"]
    lm = LinscaleLM(model=model, batch_size=4, max_length=64)
    tok = get_tokenizer()
    prompt = "Once upon a time"
    ids, new = tok.encode_ordinary(prompt), []
    with torch.no_grad():
        for _ in range(6):
            new.append(int(model(torch.tensor([ids + new]))[0, -1].argmax()))
    assert EOT_ID not in new
    cases = [({"max_gen_toks": 2}, 2), ({"max_new_tokens": 3}, 3), ({"max_tokens": 4}, 4),
             ({"max_completion_tokens": 5}, 5), ({"max_new_tokens": 2, "max_tokens": 5}, 2),
             ({"max_gen_toks": 3, "max_completion_tokens": 6}, 3), ({"max_tokens": None, "max_new_tokens": 4}, 4)]
    reqs = [Req(prompt, {"until": ["", "\n\n\n\n"], **budget}) for budget, _ in cases]
    out = lm.generate_until(reqs, disable_tqdm=True)
    assert out == [tok.decode(new[:n]).split("\n\n\n\n")[0] for _, n in cases]


class TaskReq(Req):  # an Instance with the task and item lm-eval gives it
    def __init__(self, task, doc_id, *args):
        super().__init__(*args)
        self.task_name, self.doc_id = task, doc_id


def test_long_context_is_cut_from_the_left_and_counted_per_task(models):
    """What lm-eval does when context + continuation exceed the window: the continuation is scored whole and
    the context cut from the left (reference: one unbatched forward pass over the last max_length+1 tokens);
    the items so cut are counted per task. In a window that holds everything nothing is cut and the scores are
    those of the whole context."""
    model = models["hgrn2"]
    long_ctx = "A very long question about the colour of the sky over the old harbour town " * 2
    items = [("t1", 0, "The sky is", " blue"), ("t1", 0, "The sky is", " green"),
             ("t1", 1, long_ctx, " blue"), ("t1", 1, long_ctx, " a shade of green and grey"),
             ("t2", 0, long_ctx, " yes"), ("t2", 1, "Short", " no")]
    lens = [len(sum(encode_pair(c, k), [])) for _, _, c, k in items]
    window = 16
    assert sorted(set(n > window + 1 for n in lens)) == [False, True]   # some are cut, some are not
    assert max(lens) <= 64 + 1                                           # a window of 64 holds every one
    for w, cut in ((window, {"t1": {1}, "t2": {0}}), (64, {})):
        lm = LinscaleLM(model=model, batch_size=3, max_length=w)
        got = lm.loglikelihood([TaskReq(t, d, c, k) for t, d, c, k in items], disable_tqdm=True)
        for (_, _, c, k), (lp, greedy) in zip(items, got):
            ce, ke = encode_pair(c, k)
            ids = (ce + ke)[-(w + 1):]   # the left-cut window, scored by hand
            with torch.no_grad():
                logp = torch.log_softmax(model(torch.tensor([ids[:-1]])).double(), -1)[0]
            pos = range(len(ids) - 1 - len(ke), len(ids) - 1)
            assert lp == pytest.approx(sum(float(logp[q, t]) for q, t in zip(pos, ke)), rel=1e-4, abs=1e-3)
            assert greedy == all(int(logp[q].argmax()) == t for q, t in zip(pos, ke))
        assert lm.truncated == cut
    # the whole window: the same numbers as the full, uncut context
    lm = LinscaleLM(model=model, batch_size=3, max_length=64)
    (lp, _), = lm.loglikelihood([TaskReq("t1", 1, long_ctx, " blue")], disable_tqdm=True)
    ce, ke = encode_pair(long_ctx, " blue")
    assert lp == pytest.approx(direct_logprob(model, ce, ke, 10 ** 6)[0], rel=1e-4, abs=1e-3)


def test_a_continuation_longer_than_the_window_names_task_item_and_window(models):
    """A continuation longer than the window cannot be scored whole (cutting it would sum fewer tokens and
    mis-score the item): refused before anything is scored, naming the task, the item and the window that fits
    every continuation; the choices of one item are named once."""
    lm = LinscaleLM(model=models["tnl"], batch_size=2, max_length=8)
    long = " one two three four five six seven eight nine ten"
    longer = long + " eleven twelve"
    reqs = [TaskReq("piqa_local", 0, "Q", " a"), TaskReq("piqa_local", 3, "Q", long),
            TaskReq("piqa_local", 3, "Q", " b"), TaskReq("arc_easy_local", 5, "Q", longer),
            TaskReq("arc_easy_local", 5, "Q", longer + " x")]
    need = len(encode_pair("Q", longer + " x")[1])
    assert need > len(encode_pair("Q", long)[1]) > 8
    with pytest.raises(ValueError) as err:
        lm.loglikelihood(reqs, disable_tqdm=True)
    msg = str(err.value)
    assert msg.startswith(f"task arc_easy_local, item 5: a continuation of {need} tokens is longer than the scoring "
                          f"window max_length 8")
    assert "1 other(s) do not fit either (task piqa_local, item 3)" in msg
    assert f"Pass --max-length {need} or more" in msg and f"max_length={need}" in msg
    assert lm.truncated == {}   # refused before anything was counted or scored
    lm = LinscaleLM(model=models["tnl"], batch_size=2, max_length=need)
    assert len(lm.loglikelihood(reqs, disable_tqdm=True)) == len(reqs)


def test_a_continuation_merged_into_the_context_is_refused_saying_why(models):
    """lm-eval's split gives the continuation the tokens of context+continuation past the context's own: "Number: 1"
    + "2" is tokenised as "Number: 12", so the non-empty choice "2" gets no token (scored 0 it would always win).
    The error says so, instead of calling a non-empty continuation empty; separated by a space it is scored."""
    tok = get_tokenizer()
    ctx_ids = tok.encode_ordinary("Number: 1")
    assert len(tok.encode_ordinary("Number: 12")) == len(ctx_ids)           # the merge, by the tokenizer itself
    lm = LinscaleLM(model=models["tnl"], batch_size=2, max_length=64)
    with pytest.raises(ValueError, match=r"request 0 has no continuation token to score: .*merges into the last "
                                         r"context token.*target_delimiter"):
        lm.loglikelihood([Req("Number: 1", "2")], disable_tqdm=True)
    (lp, _), = lm.loglikelihood([Req("Number: 1", " 2")], disable_tqdm=True)
    assert lp == pytest.approx(direct_logprob(models["tnl"], ctx_ids, tok.encode_ordinary(" 2"), 64)[0], rel=1e-4)


def test_bad_batch_size_or_dtype_is_one_clear_error(tmp_path):
    """model_args are checked before the weights load: batch_size must be a positive integer (lm-eval's auto
    and auto:N mean 8), dtype one the adapter knows, max_length and max_gen_toks positive; anything else is a
    ValueError naming the argument."""
    torch.manual_seed(0)
    export = save_pretrained(build_model("hgrn2", "tiny", max_seq_len=64), tmp_path / "export")
    for bad in ("0", "-2", "abc", "8x", "auto8"):
        with pytest.raises(ValueError, match="batch_size"):
            LinscaleLM.create_from_arg_string(f"pretrained={export},device=cpu,batch_size={bad}")
    with pytest.raises(ValueError, match="batch_size"):   # the CLI's --batch_size, when model_args has none
        LinscaleLM.create_from_arg_string(f"pretrained={export},device=cpu", {"batch_size": 0, "device": "cpu"})
    for bad in ("bf16", "torch.bfloat16", "int8"):
        with pytest.raises(ValueError, match="dtype"):
            LinscaleLM(pretrained=str(export), device="cpu", dtype=bad)
    for bad in ("0", "-5", "abc"):   # 0 fell back to the training context silently
        with pytest.raises(ValueError, match="max_length"):
            LinscaleLM.create_from_arg_string(f"pretrained={export},device=cpu,max_length={bad}")
    with pytest.raises(ValueError, match="max_gen_toks"):
        LinscaleLM.create_from_arg_string(f"pretrained={export},device=cpu,max_gen_toks=0")
    assert LinscaleLM.create_from_arg_string(f"pretrained={export},device=cpu,max_length=32").max_length == 32
    for given, expect in (("auto", 8), ("auto:4", 8), ("3", 3), (5, 5)):
        assert LinscaleLM(pretrained=str(export), device="cpu", batch_size=given).batch_size_per_gpu == expect
    lm = LinscaleLM(pretrained=str(export), device="cpu", dtype="bfloat16")
    assert next(lm.model.parameters()).dtype == torch.bfloat16


def test_perplexity_functions_match_lm_eval_tasks(models, tmp_path):
    """Our WikiText-2 and LAMBADA code and lm-eval's task pipeline (our local YAMLs, its detokenizer and
    metrics) through the adapter give the same numbers, on user files in the shared-data layout."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    from evaluation import perplexity
    from evaluation.lm_eval_adapter import tasks_dir
    wt = tmp_path / "wikitext-2-raw" / "wiki.test.raw"
    wt.parent.mkdir()
    wt.write_text(" \n = Page One = \n \n The river flows @-@ east , past 1 @,@ 000 trees . \n \n"
                  " = = Section = = \n \n It 's \" quoted \" ( here ) . \n \n = Page Two = \n \n Short page . \n \n")
    lam = tmp_path / "lambada" / "lambada_test.jsonl"
    lam.parent.mkdir()
    lam.write_text("".join(json.dumps({"text": t}) + "\n" for t in
                           ["She opened the door and saw her old friend Tom", "He paid the bill and left the"]))
    model = models["tnl"]
    ours_wt = perplexity.wikitext_perplexity(model, wt, max_length=16, batch_size=2)
    ours_lam = perplexity.lambada_openai(model, lam, max_length=16, batch_size=2)
    assert ours_wt["documents"] == 2 and ours_lam["examples"] == 2
    lm = LinscaleLM(model=model, batch_size=2, max_length=16)
    res = lm_eval.simple_evaluate(model=lm, tasks=["wikitext_local", "lambada_openai_local"],
                                  task_manager=TaskManager(include_path=str(tasks_dir()),
                                                           metadata={"data_dir": str(tmp_path)}),
                                  bootstrap_iters=0)["results"]
    assert res["wikitext_local"]["word_perplexity,none"] == pytest.approx(ours_wt["word_perplexity"], rel=1e-5)
    assert res["wikitext_local"]["bits_per_byte,none"] == pytest.approx(ours_wt["bits_per_byte"], rel=1e-5)
    assert res["lambada_openai_local"]["perplexity,none"] == pytest.approx(ours_lam["perplexity"], rel=1e-5)
    assert res["lambada_openai_local"]["acc,none"] == ours_lam["acc"]
    # and the definition itself: exp(-Σ ll / Σ words) with words counted on the original pages
    assert ours_wt["word_perplexity"] == pytest.approx(math.exp(-ours_wt["loglikelihood"] / ours_wt["words"]))


def test_local_multiple_choice_task_through_adapter(models, tmp_path):
    """A tiny lm-eval task (local jsonl) run by `lm_eval` machinery on a saved export: acc equals the
    argmax of directly computed choice log-likelihoods."""
    import lm_eval
    from lm_eval.tasks import TaskManager
    rows = [{"q": "The sky is", "choices": [" blue", " green", " loud"], "label": 0},
            {"q": "Two plus two is", "choices": [" four", " five"], "label": 1},
            {"q": "Fire is", "choices": [" hot", " cold"], "label": 0}]
    write_tiny_mc_task(tmp_path, "tiny_mc", rows)
    model = models["cos2"]
    save_pretrained(model, tmp_path / "export", extra={"step": 1, "tokens": 2, "flops": 3.0})
    res = lm_eval.simple_evaluate(model="linscale", model_args=f"pretrained={tmp_path / 'export'},device=cpu",
                                  tasks=["tiny_mc"], task_manager=TaskManager(include_path=str(tmp_path)))
    tok = get_tokenizer()
    hits = 0
    for r in rows:
        lps = [direct_logprob(model, tok.encode_ordinary(r["q"]), tok.encode_ordinary(c), 64)[0] for c in r["choices"]]
        hits += int(max(range(len(lps)), key=lps.__getitem__) == r["label"])
    assert res["results"]["tiny_mc"]["acc,none"] == pytest.approx(hits / len(rows))


def test_commonsense_configs_load_local_data(shared_data):
    """Every CSR loader reads the shared data folder with the published item counts; the two converted formats
    (HellaSwag, WinoGrande) also build valid lm-eval requests through their configs."""
    from lm_eval.tasks import TaskManager, get_task_dict

    from evaluation import local_data
    from evaluation.lm_eval_adapter import tasks_dir
    from evaluation.sweep import CSR_TASKS
    expected = {"boolq": 3270, "piqa": 1838, "siqa": 1954, "hellaswag": 10042, "winogrande": 1267,
                "arc_easy": 2376, "arc_challenge": 1172, "openbookqa": 500}
    for t in CSR_TASKS:
        (split,) = getattr(local_data, f"load_{t}")(data_dir=shared_data / "eval").values()
        assert len(split) == expected[t]
    tm = TaskManager(include_path=str(tasks_dir()), metadata={"data_dir": str(shared_data / "eval")})
    tasks = get_task_dict(["winogrande_local", "hellaswag_local"], tm)
    wino = tasks["winogrande_local"]
    doc = next(iter(wino.eval_docs))
    assert wino.doc_to_choice(doc)[wino.doc_to_text(doc)].startswith("Sarah was a much better surgeon")
    hs = tasks["hellaswag_local"]
    doc = next(iter(hs.eval_docs))
    assert doc["query"] == "Roof shingle removal: A man is sitting on a roof. he" and len(doc["choices"]) == 4
