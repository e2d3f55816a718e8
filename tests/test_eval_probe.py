"""Evaluation inputs an expert user gets wrong, and what they must get: label files of another convention refused
(lm-eval scores an out-of-range gold label as a miss for every model, silently), lm-eval's command with one
`error:` line for a bad export, and a scoring window past LLaMA's RoPE table scored, as a direct float64 forward
pass of the same weights scores it."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from data_pipeline.tokenizer import get_tokenizer
from evaluation import local_data
from models import build_model, load_pretrained, save_pretrained


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _ai2(label_key: str) -> dict:
    return {"id": "q1", "question": {"stem": "Which?", "choices": [{"text": t, "label": lab} for t, lab in
                                                                   zip(("one", "two", "three"), "ABC")]},
            "answerKey": label_key}


@pytest.fixture
def eval_dir(tmp_path: Path) -> Path:
    """A shared-data eval/ folder with 3 items per commonsense task, every label valid."""
    d = tmp_path / "eval"
    _jsonl(d / "piqa" / "valid.jsonl", [{"goal": f"g{i}", "sol1": "a", "sol2": "b"} for i in range(3)])
    (d / "piqa" / "valid-labels.lst").write_text("0\n1\n1\n")
    _jsonl(d / "siqa" / "dev.jsonl", [{"context": "c", "question": "q", "answerA": "x", "answerB": "y",
                                       "answerC": "z"} for _ in range(3)])
    (d / "siqa" / "dev-labels.lst").write_text("3\n1\n2\n")
    _jsonl(d / "hellaswag" / "hellaswag_val_from_klosax.jsonl",
           [{"ind": i, "ctx": "Act: a man", "endings": ["e0", "e1", "e2", "e3"], "label": i} for i in range(3)])
    _jsonl(d / "winogrande" / "winogrande_llmfoundry_format.jsonl",
           [{"context_options": ["A x", "A y"], "continuation": "ran.", "gold": g} for g in (0, 1, 1)])
    _jsonl(d / "arc" / "ARC-Easy-Test.jsonl", [_ai2("B")])
    _jsonl(d / "openbookqa" / "test.jsonl", [_ai2(" C")])   # lm-eval's openbookqa strips the key's left spaces
    return d


def test_label_files_of_another_convention_are_refused(eval_dir):
    """Valid labels load, each to the gold answer the raw files name (hand-read below); a label that names no
    choice (SIQA's labels written 0-based, PIQA's 1-based, a HellaSwag index past its endings, a WinoGrande gold
    of 2, an answerKey that is no choice label) is an error naming the file and the item, not a dataset that
    lm-eval would score as a miss on that item for every model."""
    (piqa,) = local_data.load_piqa(data_dir=eval_dir).values()
    assert [r["label"] for r in piqa] == [0, 1, 1]
    (siqa,) = local_data.load_siqa(data_dir=eval_dir).values()
    assert [[r["answerA"], r["answerB"], r["answerC"]][int(r["label"]) - 1] for r in siqa] == ["z", "x", "y"]
    (hs,) = local_data.load_hellaswag(data_dir=eval_dir).values()
    assert [r["endings"][int(r["label"])] for r in hs] == ["e0", "e1", "e2"]
    (wg,) = local_data.load_winogrande(data_dir=eval_dir).values()
    assert [local_data.winogrande_doc_to_text(r) for r in wg] == [0, 1, 1]
    (arc,) = local_data.load_arc_easy(data_dir=eval_dir).values()
    assert arc[0]["choices"]["text"][arc[0]["choices"]["label"].index(arc[0]["answerKey"])] == "two"
    (obqa,) = local_data.load_openbookqa(data_dir=eval_dir).values()
    assert obqa[0]["choices"]["label"].index(obqa[0]["answerKey"].lstrip()) == 2

    (eval_dir / "siqa" / "dev-labels.lst").write_text("2\n0\n1\n")           # 0-based
    with pytest.raises(ValueError, match=r"dev-labels.lst: item 2 has the gold label '0'.*1-based"):
        local_data.load_siqa(data_dir=eval_dir)
    (eval_dir / "piqa" / "valid-labels.lst").write_text("1\n2\n2\n")         # 1-based
    with pytest.raises(ValueError, match=r"valid-labels.lst: item 2 has the gold label '2'"):
        local_data.load_piqa(data_dir=eval_dir)
    _jsonl(eval_dir / "hellaswag" / "hellaswag_val_from_klosax.jsonl",
           [{"ind": 0, "ctx": "Act: a man", "endings": ["e0", "e1", "e2", "e3"], "label": 4}])
    with pytest.raises(ValueError, match=r"hellaswag_val_from_klosax.jsonl: item 1 has the gold label '4'"):
        local_data.load_hellaswag(data_dir=eval_dir)
    _jsonl(eval_dir / "winogrande" / "winogrande_llmfoundry_format.jsonl",
           [{"context_options": ["A x", "A y"], "continuation": "ran.", "gold": g} for g in (1, 2)])
    with pytest.raises(ValueError, match=r"winogrande_llmfoundry_format.jsonl: item 2 has the gold label 2"):
        local_data.load_winogrande(data_dir=eval_dir)
    _jsonl(eval_dir / "arc" / "ARC-Easy-Test.jsonl", [_ai2("B"), _ai2("D")])
    with pytest.raises(ValueError, match=r"ARC-Easy-Test.jsonl: item 2 has the gold label 'D'"):
        local_data.load_arc_easy(data_dir=eval_dir)


def test_files_saved_with_a_byte_order_mark_load_as_without(eval_dir):
    """A labels file or a JSON-lines file that an editor saved with a UTF-8 byte-order mark (and CRLF line ends)
    loads to the same gold answers as the plain file: the mark is not part of the first label, which would be
    refused as a label of another convention ('\\ufeff0'), nor of the first record."""
    bom = "\ufeff"
    (eval_dir / "piqa" / "valid-labels.lst").write_text(bom + "0\r\n1\r\n1\r\n", encoding="utf-8")
    (eval_dir / "siqa" / "dev-labels.lst").write_text(bom + "3\n1\n2\n", encoding="utf-8")
    arc = eval_dir / "arc" / "ARC-Easy-Test.jsonl"
    arc.write_text(bom + arc.read_text(), encoding="utf-8")
    (piqa,) = local_data.load_piqa(data_dir=eval_dir).values()
    assert [r["label"] for r in piqa] == [0, 1, 1]
    (siqa,) = local_data.load_siqa(data_dir=eval_dir).values()
    assert [r["label"] for r in siqa] == ["3", "1", "2"]
    (rows,) = local_data.load_arc_easy(data_dir=eval_dir).values()
    assert rows[0]["id"] == "q1" and rows[0]["answerKey"] == "B"


def test_lm_eval_cli_reports_a_bad_export_in_one_line(tmp_path, capsys, monkeypatch):
    """`python -m evaluation.lm_eval_cli` on an export that does not exist, or has no weights: exit 2 and one
    `error:` line saying what is there, not a traceback."""
    from evaluation import lm_eval_cli
    monkeypatch.setattr(sys, "argv", ["lm_eval_cli"])
    torch.manual_seed(0)
    export = save_pretrained(build_model("tnl", "tiny", max_seq_len=64), tmp_path / "export")
    (Path(export) / "model.safetensors").unlink()
    for path, what in ((tmp_path / "missing", "it does not exist"),
                       (export, "it holds config.json but no model.safetensors")):
        rc = lm_eval_cli.main(["--model", "linscale", "--model_args", f"pretrained={path},device=cpu",
                               "--tasks", "piqa_local", "--limit", "1"])
        err = capsys.readouterr().err
        assert rc == 2 and "Traceback" not in err, err
        (line,) = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert str(path) in line and what in line


def _direct_logprob(model, ctx: list[int], cont: list[int]) -> float:
    """log p(cont | ctx) from one float64 forward pass over ctx + cont (no truncation)."""
    ids = torch.tensor([ctx + cont])
    with torch.no_grad():
        logp = torch.log_softmax(model.double()(ids[:, :-1])[0].double(), -1)
    return sum(float(logp[len(ctx) - 1 + i, t]) for i, t in enumerate(cont))


def test_a_window_past_llamas_rope_table_is_scored(tmp_path):
    """model_args max_length past a LLaMA export's max_seq_len (its RoPE table, which is computed, not saved)
    loads the model with a table that covers the window, as the sweep does, and scores requests of that length:
    equal to a float64 forward pass of the same weights. A model passed in with too short a table is refused
    when the adapter is made, naming the fix, not at the first long request."""
    from evaluation.lm_eval_adapter import LinscaleLM

    class Req:
        def __init__(self, *args):
            self.args = args

    torch.manual_seed(0)
    export = save_pretrained(build_model("llama", "tiny", max_seq_len=32), tmp_path / "export",
                             extra={"train_seq_len": 32})
    lm = LinscaleLM(pretrained=str(export), device="cpu", max_length=64, batch_size=2)
    assert lm.max_length == 64
    tok = get_tokenizer()
    ctx_text, cont_text = "one two three four five six seven eight nine ten " * 5, "eleven twelve"
    ctx, cont = tok.encode_ordinary(ctx_text.rstrip()), tok.encode_ordinary(" " + cont_text)
    assert 32 < len(ctx) + len(cont) <= 65
    (got, _), = lm.loglikelihood([Req(ctx_text, cont_text)], disable_tqdm=True)
    reference = load_pretrained(export, max_seq_len=len(ctx) + len(cont))
    assert got == pytest.approx(_direct_logprob(reference, ctx, cont), rel=1e-5, abs=1e-4)
    # the training context stays the default window, and the saved table is kept when it covers it
    assert LinscaleLM(pretrained=str(export), device="cpu").model.config.max_seq_len == 32
    with pytest.raises(ValueError, match=r"max_length=64 is past this llama model's max_seq_len=32"):
        LinscaleLM(model=load_pretrained(export), max_length=64)


def test_a_short_haystack_is_cycled_and_an_empty_one_refused(tmp_path):
    """A haystack file far shorter than the prompts is laid end to end as often as the prompts need (the
    docstring's "cycled"), whatever the ratio, not refused as "no text"; a file with no text adds nothing (a
    haystack of blank lines alone would test nothing); files with no text at all are refused, naming them."""
    from evaluation import niah
    tok = get_tokenizer()
    short, empty = tmp_path / "short.txt", tmp_path / "empty.txt"
    short.write_text("  The river runs past the old mill.\n")
    empty.write_text(" \n\n ")
    unit = tok.encode_ordinary("The river runs past the old mill.\n\n")
    need = 16384 + 997
    hay = niah.haystack_tokens([str(empty), str(short), str(empty)], need)
    assert len(hay) >= need and hay == unit * (len(hay) // len(unit))
    prompt = niah.build_prompt(hay, niah.Needle("qwerty", "7654321"), "standard", 2000, 100)
    assert len(prompt) == 2000
    with pytest.raises(ValueError, match=r"empty.txt hold no text"):
        niah.haystack_tokens([str(empty)], 100)
    # a gzipped haystack cut short (or not gzip at all) is a user error naming the file, not EOFError/BadGzipFile
    import gzip
    packed = gzip.compress(("The river runs past the old mill. " * 2000).encode())
    (tmp_path / "cut.txt.gz").write_bytes(packed[:len(packed) // 2])
    (tmp_path / "plain.txt.gz").write_bytes(b"plain text, not gzip")
    for name in ("cut.txt.gz", "plain.txt.gz"):
        with pytest.raises(ValueError, match=rf"haystack file .*{name}: not a readable gzip file"):
            niah.haystack_tokens([str(tmp_path / name)], 100)


def test_piqa_through_the_sweep_against_a_float64_reference(tmp_path, monkeypatch):
    """PIQA from hand-made files through launch/evaluate.py's sweep (our loader, task config and lm-eval) gives
    the acc and acc_norm of a hand computation: a float64 forward pass per choice, argmax of the log-likelihood,
    and of it divided by the choice's length in characters. A choice longer than the snapshot's training context
    (the default window) is refused naming the snapshot, the task and the flag that raises the window."""
    from evaluation import sweep as sw
    rows = [{"goal": "Keep bread fresh", "sol1": "Store it in a sealed bag.", "sol2": "Leave it in the sun."},
            {"goal": "Open a jar", "sol1": "Tap the lid and twist it.", "sol2": "Freeze it overnight."},
            {"goal": "Dry wet shoes", "sol1": "Stuff them with newspaper. " * 12, "sol2": "Boil them."},
            {"goal": "Cool soup", "sol1": "Stir it.", "sol2": "Heat it up more."}]
    labels = [0, 0, 1, 0]
    data = tmp_path / "shared"
    _jsonl(data / "eval" / "piqa" / "valid.jsonl", rows)
    (data / "eval" / "piqa" / "valid-labels.lst").write_text("".join(f"{y}\n" for y in labels))
    monkeypatch.setenv("LINSCALE_SHARED_DATA", str(data))
    torch.manual_seed(0)
    export = save_pretrained(build_model("tnl", "tiny", max_seq_len=64), tmp_path / "run" / "exports" / "step_00000001",
                             extra={"step": 1, "tokens": 64, "flops": 1.0, "train_seq_len": 32})
    cfg = sw.SweepConfig(runs=[str(tmp_path / "run")], tasks=["piqa"], device="cpu", out=str(tmp_path / "eval"),
                         plots=False)
    with pytest.raises(ValueError, match=r"run/step_00000001, task piqa: .*longer than the scoring window "
                                         r"max_length 32.*--max-length"):
        sw.sweep(cfg)
    cfg.max_length = 256
    got = sw.sweep(cfg)[0]["results"]["piqa"]

    tok = get_tokenizer()
    model = load_pretrained(export)
    acc = acc_norm = 0
    for r, y in zip(rows, labels):
        ctx = tok.encode_ordinary(f"Question: {r['goal']}\nAnswer:")
        lls = [_direct_logprob(model, ctx, tok.encode_ordinary(" " + s)) for s in (r["sol1"], r["sol2"])]
        norm = [ll / len(s) for ll, s in zip(lls, (r["sol1"], r["sol2"]))]
        acc += int(max((0, 1), key=lls.__getitem__) == y)
        acc_norm += int(max((0, 1), key=norm.__getitem__) == y)
    assert got["acc"] == acc / len(rows) and got["acc_norm"] == acc_norm / len(rows) and got["paper"] == got["acc"]
