"""An output folder used again: a part prepared again, inputs changed under prepared parts, merge stages
run out of order or left from an earlier merge; damaged compressed input; config values of the wrong
type. Each either gives the dataset a fresh prepare gives, or stops with an error that says what to run."""
import gzip
import json
import random
import re
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest

from data_pipeline import build_loader
from data_pipeline.config import parse_data_config
from data_pipeline.merge import run_task
from data_pipeline.prepare import merge, prepare
from data_pipeline.shards import documents, read_meta
from data_pipeline.sources import damage_of, open_binary
from data_pipeline.tokenizer import EOT_ID, decode
from data_utils import english_text


def _write_docs(folder: Path, name: str, seed: int, n: int = 12) -> list[str]:
    rng = random.Random(seed)
    docs = [f"Document {name} {i}. " + english_text(rng, 70) for i in range(n)]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return docs


def _config(folder: Path, **dedup) -> "DataConfig":  # noqa: F821
    return parse_data_config({"name": "re", "val_fraction": 0, "filters": {"min_chars": 50},
                              "dedup": {"shards": 4, **dedup}, "mix": {"en": 1},
                              "sources": [{"name": "s", "language": "en", "type": "jsonl",
                                           "paths": [str(folder / "*.jsonl")]}]})


def _train_docs(out: Path) -> list[str]:
    split = out / "train"
    docs = []
    for s in read_meta(split)["sources"]:
        for toks in documents(split, s["name"]):
            assert toks[-1] == EOT_ID  # every document still ends where the index says it does
            docs.append(decode(toks[:-1].tolist()))
    return sorted(docs)


def _two_parts(tmp_path: Path):
    """Two input files prepared as two parts, not merged: (input folder, output folder, config)."""
    inp = tmp_path / "in"
    _write_docs(inp, "a", 1)
    _write_docs(inp, "b", 2)
    out = tmp_path / "out"
    cfg = _config(inp)
    for p in (0, 1):
        prepare(cfg, out, workers=1, part=p, num_parts=2, do_merge=False, progress=False)
    return inp, out, cfg


def test_a_part_prepared_again_takes_the_merged_dataset_with_it(tmp_path):
    """A file added and the part prepared again without the merge: the old train/ index (which pointed
    into the rewritten token files) is gone, so nothing serves misaligned documents; the merge then gives
    what a fresh folder gives."""
    inp = tmp_path / "in"
    _write_docs(inp, "b", 1)
    out = tmp_path / "out"
    prepare(_config(inp), out, workers=1, progress=False)
    assert (out / "train" / "meta.json").is_file()
    _write_docs(inp, "a", 2)  # sorts first: every document key of the old part moves
    prepare(_config(inp), out, workers=1, do_merge=False, progress=False)
    assert not (out / "train").exists() and not (out / "stats.json").exists() and not (out / "merge").exists()
    with pytest.raises((FileNotFoundError, ValueError)):
        build_loader(str(out), 64, 4, 4)
    merge(_config(inp), out)
    fresh = tmp_path / "fresh"
    prepare(_config(inp), fresh, workers=1, progress=False)
    assert _train_docs(out) == _train_docs(fresh)
    assert json.loads((out / "stats.json").read_text())["sources"] == \
        json.loads((fresh / "stats.json").read_text())["sources"]


def test_the_merge_refuses_parts_made_from_other_files(tmp_path):
    """Two parts, then a file of part 0 rewritten: the merge names the stale part instead of joining parts
    of two different inputs; with that part prepared again it merges."""
    inp, out, cfg = _two_parts(tmp_path)
    _write_docs(inp, "a", 3, n=14)  # part 0 reads a.jsonl (files i, i + 2, ... of the sorted list)
    with pytest.raises(ValueError, match=r"parts \[0\] of 2 were prepared from other input files"):
        merge(cfg, out)
    prepare(cfg, out, workers=1, part=0, num_parts=2, do_merge=False, progress=False)
    merge(cfg, out)
    fresh = tmp_path / "fresh"
    prepare(cfg, fresh, workers=1, progress=False)
    assert _train_docs(out) == _train_docs(fresh)


def test_parts_of_two_part_counts_are_named(tmp_path):
    inp = tmp_path / "in"
    for k in range(3):
        _write_docs(inp, f"f{k}", k)
    out = tmp_path / "out"
    cfg = _config(inp)
    for p in (0, 1, 2):
        prepare(cfg, out, workers=1, part=p, num_parts=3, do_merge=False, progress=False)
    prepare(cfg, out, workers=1, part=0, num_parts=2, do_merge=False, progress=False)
    with pytest.raises(ValueError, match=r"different --num-parts \(--num-parts 2: parts \[0\]; --num-parts 3: "
                                         r"parts \[1, 2\]\)"):
        merge(cfg, out)


def test_fewer_parts_in_a_used_folder_replace_the_earlier_parts(tmp_path):
    """A folder prepared with 2 parts, prepared again with 1: the part (and token files) past the new count
    are removed instead of failing the merge on a mix of part counts; the result is a fresh folder's."""
    inp = tmp_path / "in"
    _write_docs(inp, "a", 1)
    _write_docs(inp, "b", 2)
    out, cfg = tmp_path / "out", _config(inp)
    prepare(cfg, out, workers=1, num_parts=2, progress=False)
    assert list((out / "tokens" / "s").glob("p00001-*"))
    prepare(cfg, out, workers=1, num_parts=1, progress=False)
    assert sorted(d.name for d in (out / "parts").iterdir()) == ["part-00000"]
    assert not list((out / "tokens" / "s").glob("p00001-*"))
    fresh = tmp_path / "fresh"
    prepare(cfg, fresh, workers=1, num_parts=1, progress=False)
    assert _train_docs(out) == _train_docs(fresh)
    assert json.loads((out / "stats.json").read_text())["sources"] == \
        json.loads((fresh / "stats.json").read_text())["sources"]


def test_merge_outputs_of_an_earlier_config_are_not_read(tmp_path):
    """The same folder prepared again with other dedup settings (other shard counts, threshold): the merge
    reads only its own stage outputs, so the result is a fresh folder's."""
    inp = tmp_path / "in"
    docs = _write_docs(inp, "a", 1, n=20)
    rng = random.Random(5)
    near = [d.replace(".", " indeed.", 1) if rng.random() < 0.5 else d for d in docs]  # near copies
    (inp / "b.jsonl").write_text("".join(json.dumps({"text": d + " Again."}) + "\n" for d in near))
    out = tmp_path / "out"
    prepare(_config(inp, threshold=0.5, shards=16), out, workers=1, progress=False)
    strict = _config(inp, threshold=0.95, shards=4)
    prepare(strict, out, workers=1, progress=False)
    fresh = tmp_path / "fresh"
    prepare(strict, fresh, workers=1, progress=False)
    assert _train_docs(out) == _train_docs(fresh)
    assert json.loads((out / "stats.json").read_text())["sources"] == \
        json.loads((fresh / "stats.json").read_text())["sources"]


def test_merge_stages_out_of_order_say_which_stage_to_run(tmp_path):
    _, out, cfg = _two_parts(tmp_path)
    with pytest.raises(FileNotFoundError, match="outputs of stage 'exact' are missing"):
        run_task(cfg, out, "index", 0)
    for t in range(4):
        run_task(cfg, out, "exact", t)
    with pytest.raises(FileNotFoundError, match="outputs of stage 'components' are missing"):
        run_task(cfg, out, "index", 0)
    run_task(cfg, out, "exact", 3)  # a stage's task run twice is harmless
    with pytest.raises(FileNotFoundError, match="outputs of stage 'pairs' are missing"):
        run_task(cfg, out, "components", 0)


def test_token_files_changed_after_the_merge_are_refused(tmp_path):
    inp = tmp_path / "in"
    _write_docs(inp, "a", 1)
    out = tmp_path / "out"
    prepare(_config(inp), out, workers=1, progress=False)
    token_file = next((out / "tokens" / "s").glob("*.tokens.bin"))
    with open(token_file, "ab") as f:
        f.write(np.arange(7, dtype=np.uint32).tobytes())
    with pytest.raises(ValueError, match="the token files changed after the merge"):
        build_loader(str(out), 64, 4, 4)


def test_a_corrupt_spot_keeps_what_comes_before_it(tmp_path):
    """A gzip file damaged in the middle: everything deflate decoded before the damage is returned (not
    only what preceded the 64 KiB read in which the decompressor failed)."""
    rng = random.Random(3)
    text = "".join(json.dumps({"text": f"doc {i} " + english_text(rng, 60)}) + "\n" for i in range(4000)).encode()
    blob = gzip.compress(text)
    cut = len(blob) // 2 + 37
    (tmp_path / "d.jsonl.gz").write_bytes(blob[:cut] + b"\xff" * 64 + blob[cut + 64:])
    decodable = len(zlib.decompressobj(wbits=47).decompress(blob[:cut]))  # what the bytes before it give
    with open_binary(tmp_path / "d.jsonl.gz") as f:
        got = f.read()
        assert damage_of(f) is not None
    keep = decodable - 4096  # the last piece fed before the error is lost with it
    assert len(got) >= keep and got[:keep] == text[:keep]


@pytest.mark.parametrize("bad, key", [
    ({"weight": "2"}, "weight"), ({"paths": [5]}, "paths"), ({"name": 5}, "name"),
    ({"max_documents": -3}, "max_documents"), ({"weight": float("nan")}, "weight must be a finite number"),
    ({"weight": float("inf")}, "weight must be a finite number"),
    ({"weight": 0}, "every source's `weight` is 0, so no source would ever be trained on"),
])
def test_source_values_of_the_wrong_type_or_range(bad, key):
    src = {"name": "a", "language": "en", "paths": ["x"], **bad}
    with pytest.raises(ValueError, match=key):
        parse_data_config({"sources": [src]})


@pytest.mark.parametrize("bad, key", [
    ({"val_fraction": "0.1"}, "val_fraction"), ({"mix": ["en", "zh"]}, "mix"),
    ({"filters": {"min_chars": "200"}}, "min_chars"), ({"filters": {"max_line_bytes": -5}}, "max_line_bytes"),
    ({"dedup": {"threshold": "high"}}, "threshold"), ({"dedup": {"bands": 0}}, "bands"),
    ({"dedup": {"num_perm": 0, "bands": 1}}, "num_perm"), ({"dedup": {"exact": "no"}}, "exact"),
    ({"dedup": {"ngram": 0}}, "ngram"), ({"shard_tokens": 0}, "shard_tokens"),
    ({"mix": {"en": 1}, "sources": [{"name": "z", "language": "zh", "paths": ["x"]}]}, "gives no weight"),
    ({"mix": {"en": float("inf")}}, "finite weights"), ({"mix": {"en": float("nan")}}, "finite weights"),
    ({"mix": {"en": 0, "zh": 1}}, "gives weight 0 to every language of the sources"),
    ({"sources": [{"name": "a", "language": "en", "paths": ["x"], "weight": 0},
                  {"name": "b", "language": "zh", "paths": ["y"], "weight": 0.0}]}, "every source's `weight` is 0"),
])
def test_config_values_of_the_wrong_type_or_range(bad, key):
    raw = {"sources": [{"name": "a", "language": "en", "paths": ["x"]}], **bad}
    with pytest.raises(ValueError, match=re.escape(key)):
        parse_data_config(raw)
    with pytest.raises(ValueError, match="a data config is a mapping"):
        parse_data_config("just a string")


def test_weight_zero_for_some_sources_leaves_them_out():
    """0 for some sources (or languages) is a choice, not an error, while another share is > 0."""
    two = [{"name": "a", "language": "en", "paths": ["x"]}, {"name": "b", "language": "zh", "paths": ["y"]}]
    parse_data_config({"sources": two, "mix": {"en": 0, "zh": 1}})
    parse_data_config({"sources": [{**two[0], "weight": 0}, {**two[1], "weight": 2}]})


_KILLED_WORKER = """
import os, signal, sys
import data_pipeline.prepare as prep
from data_pipeline.config import parse_data_config
prep.BATCH_CHARS = 2000  # many small batches
real = prep._process
def dies_on_the_third(batch):
    if batch.keys[0] & 0xFFFFFFFF >= 4:
        os.kill(os.getpid(), signal.SIGKILL)  # what the out-of-memory killer does
    return real(batch)
prep._process = dies_on_the_third
cfg = parse_data_config({"name": "k", "val_fraction": 0, "filters": {"min_chars": 50}, "mix": {"en": 1},
                         "sources": [{"name": "s", "language": "en", "type": "jsonl", "paths": [sys.argv[1]]}]})
try:
    prep.prepare(cfg, sys.argv[2], workers=2, progress=False)
except RuntimeError as err:
    print("ERROR", err)
"""


def test_a_worker_killed_mid_prepare_ends_it_with_an_error(tmp_path):
    """A worker process killed (as by the out-of-memory killer) stops prepare with an error that says so,
    instead of the parent waiting for that worker's batch forever."""
    import subprocess
    import sys
    from checkpoint_utils import env
    _write_docs(tmp_path / "in", "a", 1, n=30)
    proc = subprocess.run([sys.executable, "-c", _KILLED_WORKER, str(tmp_path / "in" / "a.jsonl"), str(tmp_path / "out")],
                          env=env(), capture_output=True, text=True, timeout=120)
    assert "ERROR a prepare worker process died" in proc.stdout, proc.stdout + proc.stderr
    assert not (tmp_path / "out" / "parts" / "part-00000" / "part.json").exists()


def test_ctrl_c_stops_a_pooled_prepare(tmp_path):
    """Ctrl-C (SIGINT to the terminal's process group) during `--workers 2`: prepare_data exits with the
    interrupted code within seconds, and no worker prints a traceback of its own."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from checkpoint_utils import ROOT, env
    rng = random.Random(4)
    (tmp_path / "in").mkdir()
    with open(tmp_path / "in" / "a.jsonl", "w") as f:  # enough to keep two workers busy for a while
        for i in range(30000):
            f.write(json.dumps({"text": f"Document {i}. " + english_text(rng, 120)}) + "\n")
    (tmp_path / "c.yaml").write_text(json.dumps({"name": "c", "val_fraction": 0, "mix": {"en": 1}, "sources": [
        {"name": "s", "language": "en", "type": "jsonl", "paths": [str(tmp_path / "in" / "a.jsonl")]}]}))
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch" / "prepare_data.py"), "--config",
                             str(tmp_path / "c.yaml"), "--out", str(tmp_path / "out"), "--workers", "2",
                             "--no-progress"], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.time() + 60
    while time.time() < deadline and len(_children(proc.pid)) < 2:  # the workers are up
        time.sleep(0.2)
    time.sleep(1.0)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted" in err and "Traceback" not in err, err[-3000:]


_SLOW_WORKERS = """
import sys, time
import data_pipeline.prepare as prep
prep.BATCH_CHARS = 2000  # many small batches, each slow: the part is still running when it is stopped
real = prep._process
def slow(batch):
    time.sleep(0.3)
    return real(batch)
prep._process = slow
from launch.prepare_data import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_a_pooled_prepare_stopped_leaves_no_workers_and_no_part(tmp_path, sig):
    """A signal to the prepare process alone during `--workers 2`: SIGTERM (`kill PID`, a scheduler's stop)
    acts as Ctrl-C (exit 130, the pool shut down); after SIGKILL the workers end with it instead of
    waiting for their next batch forever. Either way no worker is left and the part is not recorded as
    done; prepare_data run again completes."""
    import os
    import signal
    import subprocess
    import time
    from checkpoint_utils import ROOT, env
    _write_docs(tmp_path / "in", "a", 1, n=160)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(json.dumps({"name": "c", "val_fraction": 0, "filters": {"min_chars": 50}, "mix": {"en": 1},
                               "sources": [{"name": "s", "language": "en", "type": "jsonl",
                                            "paths": [str(tmp_path / "in" / "*.jsonl")]}]}))
    args = ["--config", str(cfg), "--out", str(tmp_path / "out"), "--workers", "2", "--no-progress"]
    log = tmp_path / "log.txt"  # a file, not a pipe: a worker left running would hold a pipe open
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-c", _SLOW_WORKERS, *args], env=env(), cwd=ROOT,
                                stdout=f, stderr=subprocess.STDOUT)
    workers: list[int] = []
    try:
        deadline = time.time() + 60
        while time.time() < deadline and len(_children(proc.pid)) < 2 and proc.poll() is None:  # workers up
            time.sleep(0.05)
        workers = _children(proc.pid)
        assert len(workers) == 2, log.read_text()
        time.sleep(0.5)
        os.kill(proc.pid, getattr(signal, sig))  # the parent only, not its process group
        proc.wait(timeout=60)
        err = log.read_text()
        if sig == "SIGTERM":
            assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err[-3000:]
        else:
            assert proc.returncode == -signal.SIGKILL
        deadline = time.time() + 10
        while time.time() < deadline and any(map(_alive, workers)):
            time.sleep(0.05)
        assert not any(map(_alive, workers)), f"workers left running after {sig}"
    finally:
        for pid in [proc.pid, *workers]:  # a failure above leaves nothing behind
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert (tmp_path / "out" / "parts" / "part-00000").is_dir()  # stopped mid-part, not before it
    assert not (tmp_path / "out" / "parts" / "part-00000" / "part.json").exists()
    assert not (tmp_path / "out" / "train").exists()
    again = subprocess.run([sys.executable, str(ROOT / "launch" / "prepare_data.py"), *args], env=env(),
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr[-3000:]
    assert (tmp_path / "out" / "parts" / "part-00000" / "part.json").is_file()
    assert _train_docs(tmp_path / "out")


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (an exited orphan may linger as a zombie where nothing reaps it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _children(pid: int) -> list[int]:
    import subprocess
    return [int(x) for x in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
