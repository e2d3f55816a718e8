"""The table of bad inputs in docs/errors.md, run row by row: every row's `id` has a test here named
`test_<id>` (with `-` as `_`), and `test_table_and_tests_agree` keeps the two in step.

Each test gives the bad input the way a user would (the CLI's main in this process, or a subprocess
where what matters is what the terminal shows) and checks the documented behaviour: the exit code, one
`error:` line naming the input, the problem and the fix, no Python traceback, and nothing lost or
silently wrong on disk. Tiny models, a few steps, a 256-token synthetic dataset: the module runs in about
a minute on 2 CPU cores."""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from checkpoint_utils import one_thread, small_dataset  # noqa: F401  (fixtures)
from checkpoint_utils import ABORT_AT_EXIT_HOOK, ROOT, env, free_port, losses, make_dataset, pretrain_cmd, run_flags

DOC = ROOT / "docs" / "errors.md"


def pretrain(argv: list[str], capsys) -> tuple[int, str, str]:
    """launch/pretrain.py's main in this process: (exit code, stdout, stderr)."""
    from pretrain.trainer import main
    rc = main([str(a) for a in argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def cli(script: str, *args: str, timeout: int = 240, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    e = env()
    e.update(extra_env or {})
    e = {k: v for k, v in e.items() if v is not None}  # None in extra_env: unset
    return subprocess.run([sys.executable, str(ROOT / "launch" / script), *map(str, args)], env=e,
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def in_process(main, argv: list, capsys) -> tuple[int, str]:
    """A launch script's main(argv) in this process: (exit code, stderr); argparse's usage errors too."""
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    return rc, capsys.readouterr().err


def clis(*calls: tuple) -> list[subprocess.CompletedProcess]:
    """Several `cli(script, *args)` calls at once (each pays Python's and torch's start-up)."""
    procs = [(c, subprocess.Popen([sys.executable, str(ROOT / "launch" / c[0]), *map(str, c[1:])], env=env(),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)) for c in calls]
    out = []
    for c, p in procs:
        o, e = p.communicate(timeout=240)
        out.append(subprocess.CompletedProcess([c[0], *c[1:]], p.returncode, o, e))
    return out


def one_error_line(err: str) -> str:
    """The `error:` line of a failed command's stderr; there must be exactly one and no traceback."""
    assert "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if "error:" in ln]
    assert len(lines) == 1, err
    return lines[0]


def table_ids() -> list[str]:
    ids = re.findall(r"^\| `([a-z0-9-]+)` \|", DOC.read_text(), flags=re.M)
    assert ids, f"no table rows found in {DOC}"
    return ids


def test_table_and_tests_agree():
    ids = table_ids()
    assert len(ids) == len(set(ids)), "duplicate ids in docs/errors.md"
    here = {name[len("test_"):].replace("_", "-") for name in globals() if name.startswith("test_")}
    here.discard("table-and-tests-agree")
    assert set(ids) == here, f"rows without a test: {set(ids) - here}; tests without a row: {here - set(ids)}"


# ---------------------------------------------------------------------------------------------------
# flags and config files
# ---------------------------------------------------------------------------------------------------

def _all_fields():
    from pretrain.config import SECTIONS, RunConfig
    for f in dataclasses.fields(RunConfig):
        if f.name not in SECTIONS and f.name != "model_overrides":
            yield f.name, f
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            yield f"{section}.{f.name}", f


def _outside(meta: dict, kind: str):
    """A value just outside a field's declared range."""
    if "ge" in meta:
        v = meta["ge"] - 1
    elif "gt" in meta:
        v = meta["gt"] - (1 if kind == "int" else 0.5)
    elif "le" in meta:
        v = meta["le"] + 1
    else:
        v = meta["lt"] + (0 if kind == "int" else 0.5)
    return int(v) if kind == "int" else float(v)


def test_flag_out_of_range():
    """Every numeric flag, present and future: a value outside its declared range is refused at parse time
    with a message naming the flag, the value and the allowed range; every int/float/str field declares
    a range, choices or is a path (so no new flag can skip validation)."""
    from pretrain.config import flag_name, field_kind, parse_config
    from pretrain.errors import ConfigError
    checked = 0
    for path, f in _all_fields():
        kind = field_kind(f)
        meta = dict(f.metadata)
        if kind in ("int", "float", "str"):
            assert meta.get("choices") or meta.get("path") or {"ge", "gt", "le", "lt"} & set(meta), \
                f"config field {path} declares no range or choices (use pretrain.config.param)"
        if "choices" in meta or kind not in ("int", "float") or not {"ge", "gt", "le", "lt"} & set(meta):
            continue
        bad = _outside(meta, kind)
        flag = flag_name(path) if "." in path else f"--{path}"
        with pytest.raises(ConfigError) as err:
            parse_config([flag, str(bad)])
        msg = str(err.value)
        assert msg.startswith(f"{flag} ") and "out of range; allowed:" in msg, msg
        assert str(bad).rstrip("0").rstrip(".") in msg, msg
        checked += 1
    assert checked >= 20
    # the issue's cases, with their messages
    for argv, expect in ((["--grad-clip", "-1"], "--grad-clip -1: out of range; allowed: >= 0, or inf"),
                         (["--warmup-steps", "-5"], "--warmup-steps -5: out of range; allowed: >= 0"),
                         (["--max-steps", "-1"], "--max-steps -1: out of range; allowed: >= 0"),
                         (["--log-every", "0"], "--log-every 0: out of range; allowed: >= 1"),
                         (["--beta2", "1"], "--beta2 1: out of range; allowed: >= 0 and < 1"),
                         (["--lr", "nan"], "--lr nan: must be a finite number")):
        with pytest.raises(ConfigError, match=re.escape(expect)):
            parse_config(argv)


def test_flag_not_a_choice():
    """Every enumerated flag: a value outside its choices is refused, listing the choices."""
    from pretrain.config import flag_name, parse_config
    from pretrain.errors import ConfigError
    checked = 0
    for path, f in _all_fields():
        choices = f.metadata.get("choices")
        if not choices:
            continue
        flag = flag_name(path) if "." in path else f"--{path}"
        bogus = "bogus" if isinstance(choices[0], str) else "7"
        with pytest.raises(ConfigError) as err:
            parse_config([flag, bogus])
        msg = str(err.value)
        assert msg.startswith(f"{flag} ") and "choose one of " + ", ".join(map(str, choices)) in msg, msg
        checked += 1
    assert checked >= 7
    for argv, expect in ((["--backend", "bogus"], "--backend 'bogus': not allowed; choose one of auto, nccl, gloo"),
                         (["--device", "tpu"], "--device 'tpu': not allowed; choose one of auto, cpu, cuda"),
                         (["--zero", "4"], "--zero 4: not allowed; choose one of 0, 1, 2, 3")):
        with pytest.raises(ConfigError, match=re.escape(expect)):
            parse_config(argv)


def test_flag_not_a_number(capsys):
    """A flag that is not a number: argparse's usage error (exit 2), no traceback."""
    with pytest.raises(SystemExit) as exc:
        pretrain(["--lr", "fast"], capsys)
    assert exc.value.code == 2
    assert "argument --lr: invalid float value: 'fast'" in capsys.readouterr().err


def test_bad_flags_on_the_command_line():
    """What the terminal shows: one line, exit 2, for the issue's silently accepted flags."""
    proc = cli("pretrain.py", "--grad-clip", "-1", "--out", "/nonexistent/never-created")
    assert proc.returncode == 2
    assert one_error_line(proc.stderr) == "error: --grad-clip -1: out of range; allowed: >= 0, or inf"
    assert not Path("/nonexistent/never-created").exists()


def test_config_file_bad_value(tmp_path):
    """A value out of range in a --config YAML names the flag, the field and the file; YAML's '1e-3'
    (a string to YAML 1.1) is read as the number it is."""
    from pretrain.config import parse_config
    from pretrain.errors import ConfigError
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("optim: {lr: 1e-3, warmup_steps: -5}\n")
    with pytest.raises(ConfigError, match=re.escape(f"--warmup-steps (optim.warmup_steps in --config {cfg_file}) -5: "
                                                    f"out of range; allowed: >= 0")):
        parse_config(["--config", str(cfg_file)])
    cfg_file.write_text("optim: {lr: 1e-3}\ntrain: {seq_len: abc}\n")
    with pytest.raises(ConfigError, match=r"--seq-len \(train.seq_len in --config .*\) 'abc': expected an integer"):
        parse_config(["--config", str(cfg_file)])
    cfg_file.write_text("optim: {lr: 1e-3}\n")
    assert parse_config(["--config", str(cfg_file)]).optim.lr == 1e-3
    cfg_file.write_text("train: {sequence_length: 4096}\n")
    with pytest.raises(ConfigError, match="unknown config field 'train.sequence_length'; known: train.seq_len"):
        parse_config(["--config", str(cfg_file)])


def test_config_file_yaml_syntax(tmp_path, capsys):
    """A YAML syntax error names the file, the line and the column."""
    cfg_file = tmp_path / "run.yaml"
    cfg_file.write_text("train:\n  seq_len: 128\n  micro_batch: [1, 2\noptim: {lr: 1e-3}\n")
    rc, _, err = pretrain(["--config", cfg_file], capsys)
    assert rc == 2
    line = one_error_line(err)
    assert f"YAML syntax error in {cfg_file}, line 4" in line, line
    data_cfg = tmp_path / "data.yaml"
    data_cfg.write_text("sources:\n  - name: s\n    paths: [a.jsonl\n  - name: t\n")
    proc = cli("prepare_data.py", "--config", data_cfg, "--out", tmp_path / "ds")
    assert proc.returncode == 2 and f"YAML syntax error in {data_cfg}, line 4" in one_error_line(proc.stderr)
    from launch.study import main as study_main
    rc, err = in_process(study_main, ["plan", "--config", data_cfg], capsys)
    assert rc == 2 and f"YAML syntax error in {data_cfg}, line 4" in one_error_line(err), err


def test_deepspeed_config_without_zero(capsys):
    """--deepspeed-config with --zero 0 (where nothing reads it) is refused instead of being ignored."""
    rc, _, err = pretrain(["--deepspeed-config", "ds.json", "--zero", "0", "--max-steps", "1"], capsys)
    assert rc == 2
    line = one_error_line(err)
    assert "--deepspeed-config ds.json is read only by DeepSpeed" in line and "pass --zero 1, 2 or 3" in line


def test_model_field_not_a_number(capsys):
    """--model FIELD=VALUE of the wrong type names the field; an unknown field lists the known ones."""
    rc, _, err = pretrain(["--model", "d_model=abc"], capsys)
    assert rc == 2 and one_error_line(err) == "error: --model d_model=abc: d_model expects an integer"
    rc, _, err = pretrain(["--model", "dmodel=128"], capsys)
    assert rc == 2 and "unknown model field 'dmodel'; known: arch, d_glu, d_model" in one_error_line(err)
    rc, _, err = pretrain(["--model", "n_heads=3"], capsys)
    assert rc == 2 and "n_heads=3 does not divide the width d_model=128" in one_error_line(err)
    # LLaMA's RoPE needs an even head width: d_model=130 (tiny: e = 65) is one line at parse time, not a
    # shape-mismatch traceback at the first step; the linear models take the shape
    rc, _, err = pretrain(["--arch", "llama", "--model", "d_model=130"], capsys)
    line = one_error_line(err)
    assert rc == 2 and line.startswith("error: --arch llama --size tiny --model d_model=130: ")
    assert "head width e = d/h must be even" in line and "gives e = 65" in line
    from pretrain.config import parse_config
    assert parse_config(["--arch", "tnl", "--model", "d_model=130"]).model().head_dim == 65


def test_rope_table_shorter_than_seq_len(tmp_path, capsys):
    """LLaMA with --model max_seq_len below --seq-len (on the command line or in --config): refused at parse
    time, before anything is written, naming the user's fix; the default table always fits --seq-len. A
    model used directly past its table names the same fix and load_pretrained's."""
    import torch

    from models import LanguageModel, model_config
    run = tmp_path / "run"
    flags = ["--arch", "llama", "--size", "tiny", "--seq-len", "64", "--global-batch-tokens", "128", "--out", run]
    rc, _, err = pretrain([*flags, "--model", "max_seq_len=32"], capsys)
    assert rc == 2 and one_error_line(err) == (
        "error: --model max_seq_len=32: LLaMA's RoPE table is shorter than --seq-len 64; pass --model "
        "max_seq_len=64 or larger (model_overrides: {max_seq_len: 64} in --config), or leave it out (the default "
        "fits --seq-len)")
    cfg = tmp_path / "run.yaml"
    cfg.write_text("model_overrides:\n  max_seq_len: 48\n")
    rc, _, err = pretrain([*flags, "--config", cfg], capsys)
    assert rc == 2 and "--model max_seq_len=48: LLaMA's RoPE table is shorter than --seq-len 64" in one_error_line(err)
    assert not run.exists()
    from pretrain.config import parse_config
    assert parse_config([*map(str, flags), "--model", "max_seq_len=64"]).model().max_seq_len == 64  # exactly fits
    assert parse_config(["--arch", "llama", "--seq-len", "16384", "--global-batch-tokens", "16384"]).model().max_seq_len \
        == 16384  # the default grows with --seq-len
    assert parse_config(["--arch", "tnl", "--seq-len", "64", "--global-batch-tokens", "128", "--model",
                         "max_seq_len=32"]).train.seq_len == 64  # linear models have no table to outgrow
    model = LanguageModel(model_config("llama", "tiny", vocab_size=64, max_seq_len=8))
    with pytest.raises(ValueError, match=re.escape("position 10 exceeds the RoPE table (max_seq_len=8); training: "
                                                   "pass --model max_seq_len=10")) as exc:
        model(torch.zeros(1, 10, dtype=torch.long))
    assert "load_pretrained(path, max_seq_len=10)" in str(exc.value)


def test_save_pretrained_of_a_wrapped_model(tmp_path):
    """A compiled model is saved under the plain model's names and loads; a module that is no language model
    is refused by its type (tests/test_export.py checks the weights bit for bit, DDP too)."""
    import torch
    from safetensors.torch import load_file

    from models import build_model, load_pretrained, save_pretrained
    model = build_model("hgrn2", "tiny", vocab_size=97)
    out = save_pretrained(torch.compile(model), tmp_path / "export", dtype=torch.bfloat16)
    saved = load_file(str(out / "model.safetensors"))
    assert saved.keys() == model.state_dict().keys() and saved["lower_bounds.bounds"].dtype == torch.float32
    assert load_pretrained(out).config == model.config
    with pytest.raises(ValueError, match=r"save_pretrained takes a models.LanguageModel \(or one wrapped by "
                                         r"torch.compile or DistributedDataParallel\), got Linear"):
        save_pretrained(torch.nn.Linear(2, 2), tmp_path / "linear")
    assert not (tmp_path / "linear").exists()


def test_load_pretrained_on_a_device_it_cannot_use(tmp_path):
    """A device name torch does not know, or a GPU this machine lacks, is named as such before the weights are
    read: not as weights 'unreadable ... damaged' with the advice to export them again, nor as an allocator
    error from inside safetensors."""
    import torch

    from models import build_model, load_pretrained, save_pretrained
    out = save_pretrained(build_model("tnl", "tiny", vocab_size=97), tmp_path / "export")
    with pytest.raises(ValueError, match=r"load_pretrained: device 'bogus' is not a device; use 'cpu', 'cuda' or "
                                         r"'cuda:N'") as exc:
        load_pretrained(out, device="bogus")
    assert "damaged" not in str(exc.value)
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU; on a machine without one, any
    with pytest.raises(ValueError, match=rf"load_pretrained: device '{missing}', but (CUDA is not available on this "
                                         rf"machine; load with device='cpu'|this machine has \d+ CUDA device)"):
        load_pretrained(out, device=missing)
    assert load_pretrained(out, device=torch.device("cpu")).embed.weight.device.type == "cpu"


@pytest.mark.parametrize("arch", ["llama", "tnl", "hgrn2", "cos2"])
def test_model_called_with_a_malformed_batch(arch):
    """Every architecture names the faulty argument the same way, for ids, targets and document offsets."""
    import torch

    from models import build_model
    torch.manual_seed(0)
    model = build_model(arch, "tiny", vocab_size=97)
    ids = torch.randint(0, 97, (2, 5))
    with pytest.raises(ValueError, match=r"input_ids holds no tokens \(shape \(2, 0\)\)"):
        model(ids[:, :0])
    with pytest.raises(ValueError, match="input_ids must be integer token ids, got dtype torch.float32"):
        model(ids.float())
    with pytest.raises(ValueError, match=r"input_ids must be \[batch, time\], got shape \(10,\)"):
        model(ids.flatten())
    bad = ids.clone()
    bad[1, 3] = 97
    with pytest.raises(ValueError, match=r"targets must lie in \[0, 97\) or be -100 \(ignored\), got 1 outside, e.g. 97"):
        model(ids, targets=bad)
    bad[1, 3] = -5
    with pytest.raises(ValueError, match="e.g. -5"):
        model(ids, targets=bad)
    with pytest.raises(ValueError, match=r"targets must have the shape of input_ids \(2, 5\), got \(2, 4\)"):
        model(ids, targets=ids[:, :4])
    with pytest.raises(ValueError, match="targets must be integer"):
        model(ids, targets=ids.float())
    for cu, msg in (([0, 3, 9], r"end at batch x time = 10.*got 0 \.\.\. 9"),
                    ([1, 4, 10], r"start at 0 .*got 1 \.\.\. 10"),
                    ([0, 4, 4, 10], r"strictly increasing \(no empty document\), got \[0, 4, 4, 10\]"),
                    ([0, 6, 4, 10], "strictly increasing")):
        with pytest.raises(ValueError, match=msg):
            model(ids, targets=ids, cu_seqlens=torch.tensor(cu, dtype=torch.int32))
    for cu in (torch.tensor([[0, 10]]), torch.tensor([0.0, 10.0]), torch.tensor([0])):
        with pytest.raises(ValueError, match="cu_seqlens must be a 1-D integer tensor"):
            model(ids, cu_seqlens=cu)
    # ignored targets (-100) and well-formed offsets pass, as do the same batches with the value checks off
    ok = ids.clone()
    ok[0, 0] = -100
    loss = model(ids, targets=ok, cu_seqlens=None if arch == "llama" else torch.tensor([0, 4, 10]))
    assert torch.isfinite(loss)
    # the shape checks read no values, so they hold where the value checks are skipped
    with pytest.raises(ValueError, match="input_ids holds no tokens"):
        model(ids[:, :0], check_ids=False)


def test_device_without_cuda(capsys, tmp_path):
    """--device cuda without a GPU: one line saying so (not a traceback)."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible here")
    rc, _, err = pretrain(["--device", "cuda", "--out", tmp_path / "run"], capsys)
    assert rc == 2
    line = one_error_line(err)
    assert "--device cuda: no CUDA device is visible here" in line and "use --device cpu" in line
    assert not (tmp_path / "run").exists()


def test_max_bad_steps_is_exact(dataset, tmp_path, capsys, monkeypatch):
    """--max-bad-steps N stops after exactly N non-finite steps in a row (exit 3, a checkpoint of that
    step); N-1 in a row do not stop the run."""
    run = tmp_path / "run"
    monkeypatch.setenv("LINSCALE_INJECT_NONFINITE", "1,2,4,5,6")
    rc, _, err = pretrain(run_flags(run, dataset, 10, "--max-bad-steps", "3", "--save-every", "0"), capsys)
    assert rc == 3
    assert one_error_line(err).startswith("error: 3 non-finite steps in a row (limit --max-bad-steps 3); "
                                          "stopped at step 7")
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["skipped"]] == [2, 3, 5, 6, 7] and rows[-1]["step"] == 7
    assert (run / "checkpoints" / "latest").read_text().strip() == "step_00000007"


def test_compile_fails(dataset, tmp_path, capsys, monkeypatch):
    """A torch.compile failure (the backend raising while it builds the first step's graph, as Inductor
    does on a kernel it cannot generate) stops the run with one line naming the failure and --no-compile;
    the same run trains eagerly with --no-compile."""
    from pretrain import train_module

    def failing_backend(gm, example_inputs):
        raise RuntimeError("cannot generate code for this graph")

    compile_blocks = train_module.compile_blocks
    monkeypatch.setattr(train_module.TorchTrainModule, "compile",
                        lambda self, backend="inductor": compile_blocks(self.model, failing_backend))
    run = tmp_path / "run"
    rc, _, err = pretrain(run_flags(run, dataset, 2, "--compile", "--save-every", "0"), capsys)
    assert rc == 3
    line = one_error_line(err)
    assert line.startswith("error: torch.compile failed in step 1 (tnl tiny, plain PyTorch, --compile true): "
                           "BackendCompilerFailed") and "cannot generate code" in line, line
    assert "--no-compile" in line and "LINSCALE_TRACEBACK=1" in line
    rc, _, _ = pretrain(run_flags(run, dataset, 2, "--no-compile", "--save-every", "0", "--overwrite"), capsys)
    assert rc == 0


def test_negative_grad_clip_never_trains(dataset, tmp_path, capsys):
    """--grad-clip -1 is refused before anything runs (it used to train uphill), and so are NaN and -inf,
    each with the range that is allowed (>= 0, or inf); --grad-clip 0 turns clipping off and trains
    downhill, and inf, which --help, the messages and the docs name alongside 0, trains bitwise as 0 does."""
    from pretrain.config import build_parser
    run = tmp_path / "run"
    rc, _, err = pretrain(run_flags(run, dataset, 6, "--grad-clip", "-1"), capsys)
    assert rc == 2 and not run.exists()
    assert one_error_line(err) == "error: --grad-clip -1: out of range; allowed: >= 0, or inf"
    for value, expect in (("nan", "error: --grad-clip nan: not a number; allowed: >= 0, or inf"),
                          ("-inf", "error: --grad-clip -inf: out of range; allowed: >= 0, or inf")):
        rc, _, err = pretrain([*run_flags(run, dataset, 6), f"--grad-clip={value}"], capsys)
        assert rc == 2 and not run.exists() and one_error_line(err) == expect, err
    help_text = " ".join(build_parser().format_help().split())
    assert "optim.grad_clip (default 1.0; >= 0, or inf; the largest global gradient norm; 0 or inf turns " \
           "clipping off)" in help_text
    rc, _, _ = pretrain(run_flags(run, dataset, 8, "--grad-clip", "0", "--save-every", "0"), capsys)
    assert rc == 0
    loss = losses(run)
    assert loss[8][0] < loss[1][0]
    unclipped = tmp_path / "unclipped"
    rc, _, _ = pretrain(run_flags(unclipped, dataset, 8, "--grad-clip", "inf", "--save-every", "0"), capsys)
    assert rc == 0 and losses(unclipped) == loss
    # a threshold this run's gradients exceed trains otherwise: the equality above is not one by chance
    clipped = tmp_path / "clipped"
    rc, _, _ = pretrain(run_flags(clipped, dataset, 8, "--grad-clip", "0.05", "--save-every", "0"), capsys)
    assert rc == 0 and losses(clipped) != loss


# ---------------------------------------------------------------------------------------------------
# the run directory
# ---------------------------------------------------------------------------------------------------

LOCK_HOLDER = """
import sys, time
sys.path.insert(0, {root!r})
from checkpoints.run_dir import RunLock
lock = RunLock({run!r}).acquire()
print("locked", flush=True)
time.sleep(120)
"""


def test_run_directory_in_use(dataset, tmp_path, capsys):
    """A second run on a directory in use is refused naming the holder (pid, host); once the holder is
    killed (-9) the kernel has released its lock and a run starts there, noting the leftover."""
    run = tmp_path / "run"
    run.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", LOCK_HOLDER.format(root=str(ROOT), run=str(run))], env=env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        rc, _, err = pretrain(run_flags(run, dataset, 2), capsys)
        assert rc == 2
        line = one_error_line(err)
        assert f"run directory {run} is in use by another run (pid {holder.pid} on host" in line
        assert "pass another --out" in line
        assert not (run / "metrics.jsonl").exists()
    finally:
        holder.kill()
        holder.wait()
    rc, out, _ = pretrain(run_flags(run, dataset, 2), capsys)
    assert rc == 0 and f"lock of an earlier run (pid {holder.pid}" in out
    assert (run / ".lock").read_text() == ""  # released at the end


def test_run_directory_lock_without_flock(tmp_path, monkeypatch):
    """Where the file system has no flock, the lock is an exclusively created file: a live holder is
    refused (how to clear it is in the message), a dead pid on this host or an earlier incarnation of the
    same Slurm job (a requeue) is taken over, and release removes the file."""
    import errno
    import fcntl
    from checkpoints.errors import RunDirectoryBusy
    from checkpoints.run_dir import RunLock

    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    run = tmp_path / "run"
    run.mkdir()
    lock = RunLock(run).acquire()
    assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
    with pytest.raises(RunDirectoryBusy, match=r"is locked by pid \d+ on host .* delete .*\.lock"):
        RunLock(run).acquire()
    lock.release()
    assert not (run / ".lock").exists()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    holder = {"pid": int(dead.stdout), "host": socket.gethostname(), "started": "x", "command": "x", "slurm_job": None}
    (run / ".lock").write_text(json.dumps(holder))
    RunLock(run).acquire().release()  # the dead pid's lock is taken over
    (run / ".lock").write_text(json.dumps({**holder, "pid": 1, "host": "elsewhere", "slurm_job": "4242"}))
    with pytest.raises(RunDirectoryBusy):
        RunLock(run).acquire()
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    RunLock(run).acquire().release()  # a requeued job takes its own old lock over


def test_fresh_start_over_an_earlier_run(dataset, tmp_path, capsys):
    """A run without --resume in a directory holding another run's checkpoints is refused (nothing is
    written); --overwrite moves the earlier run aside (nothing deleted) and starts afresh; --resume auto
    then follows this run's own checkpoints."""
    run = tmp_path / "run"
    assert pretrain(run_flags(run, dataset, 9, "--save-every", "3", "--keep-last", "0"), capsys)[0] == 0
    before = (run / "metrics.jsonl").read_text()
    rc, _, err = pretrain(run_flags(run, dataset, 4, "--save-every", "2", "--seed", "1"), capsys)
    assert rc == 2
    line = one_error_line(err)
    assert f"run directory {run} already holds a run (3 checkpoints (newest step_00000009)" in line
    assert "--resume auto" in line and "--overwrite" in line
    assert (run / "metrics.jsonl").read_text() == before
    (run / "eval").mkdir()              # launch/evaluate.py's default output: the earlier run's evaluations
    (run / "eval" / "results.json").write_text("{}")
    rc, out, _ = pretrain(run_flags(run, dataset, 4, "--save-every", "2", "--keep-last", "1", "--seed", "1",
                                    "--overwrite"), capsys)
    assert rc == 0
    moved = [p for p in run.iterdir() if p.name.startswith("overwritten-")]
    assert len(moved) == 1 and f"moved to {moved[0]}" in out
    assert not (run / "eval").exists() and (moved[0] / "eval" / "results.json").read_text() == "{}"
    assert sorted(p.name for p in (moved[0] / "checkpoints").iterdir() if p.is_dir()) == \
        ["step_00000003", "step_00000006", "step_00000009"]
    assert (moved[0] / "metrics.jsonl").read_text() == before
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["step_00000004"]
    assert [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    rc, out, _ = pretrain(run_flags(run, dataset, 6, "--save-every", "2", "--keep-last", "1", "--seed", "1",
                                    "--resume", "auto"), capsys)
    assert rc == 0 and "resumed from" in out and "step_00000004 at step 4" in out


def test_resume_auto_ignores_another_runs_checkpoint(dataset, tmp_path, capsys):
    """A newer checkpoint of another run inside this run's checkpoints/ (copied in by hand) is skipped by
    --resume auto with a warning naming it; this run's own newest one is taken, and retention leaves the
    foreign one alone."""
    import shutil
    a, b = tmp_path / "a", tmp_path / "b"
    assert pretrain(run_flags(a, dataset, 9, "--save-every", "9"), capsys)[0] == 0
    assert pretrain(run_flags(b, dataset, 4, "--save-every", "2", "--keep-last", "1"), capsys)[0] == 0
    shutil.copytree(a / "checkpoints" / "step_00000009", b / "checkpoints" / "step_00000009")
    rc, out, err = pretrain(run_flags(b, dataset, 6, "--save-every", "2", "--keep-last", "1", "--resume", "auto"),
                            capsys)
    assert rc == 0
    assert "step_00000009 belongs to another run" in err and "at step 4" in out
    assert sorted(p.name for p in (b / "checkpoints").iterdir() if p.is_dir()) == ["step_00000006", "step_00000009"]
    assert (b / "checkpoints" / "latest").read_text().strip() == "step_00000006"


def test_resume_an_earlier_checkpoint_of_this_run(dataset, tmp_path, capsys):
    """--resume with one of this run's own older checkpoints starts a new branch: the later checkpoints
    and snapshots (the abandoned branch) are moved to superseded-<time>/ (not deleted), so --resume auto
    afterwards follows the new branch and a replayed step never keeps the old branch's snapshot."""
    run = tmp_path / "run"
    flags = ("--save-every", "2", "--keep-last", "0", "--snapshot-every-tokens", str(2 * 96))
    assert pretrain(run_flags(run, dataset, 6, *flags), capsys)[0] == 0
    from checkpoints.export import export_run
    export_run(run, log=lambda m: None)  # exports of the old branch, steps 2, 4, 6
    old6 = (run / "snapshots" / "step_00000006" / "model.safetensors").read_bytes()
    old_export6 = (run / "exports" / "step_00000006" / "model.safetensors").read_bytes()
    rc, out, _ = pretrain(run_flags(run, dataset, 4, *flags, "--lr", "1e-3", "--resume",
                                    run / "checkpoints" / "step_00000002"), capsys)
    assert rc == 0 and "abandoned branch" in out
    ckpt_aside = [p for p in (run / "checkpoints").iterdir() if p.name.startswith("superseded-")]
    snap_aside = [p for p in (run / "snapshots").iterdir() if p.name.startswith("superseded-")]
    export_aside = [p for p in (run / "exports").iterdir() if p.name.startswith("superseded-")]
    assert len(ckpt_aside) == 1 and sorted(p.name for p in ckpt_aside[0].iterdir()) == ["step_00000004", "step_00000006"]
    assert len(snap_aside) == 1 and (snap_aside[0] / "step_00000006" / "model.safetensors").read_bytes() == old6
    assert len(export_aside) == 1 and sorted(p.name for p in export_aside[0].iterdir()) == ["step_00000004", "step_00000006"]
    rc, out, _ = pretrain(run_flags(run, dataset, 6, *flags, "--lr", "1e-3", "--resume", "auto"), capsys)
    assert rc == 0 and "step_00000004 at step 4" in out  # the new branch's step 4, not the old step 6
    new6 = (run / "snapshots" / "step_00000006" / "model.safetensors").read_bytes()
    assert new6 != old6  # written by the new branch (lr 1e-3), not kept from the old one
    # the export is of the new branch: step 2 (shared by both branches) is kept, steps 4 and 6 are new
    logs = []
    export_run(run, log=logs.append)
    assert [("skipped" in m) for m in logs] == [True, False, False]
    assert (run / "exports" / "step_00000006" / "model.safetensors").read_bytes() != old_export6
    # an export left of the old branch (e.g. copied back) is not taken for the new step's: written again
    (run / "exports" / "step_00000006" / "model.safetensors").write_bytes(old_export6)
    cfg6 = run / "exports" / "step_00000006" / "config.json"
    old_cfg = json.loads(cfg6.read_text())
    old_cfg["source"]["manifest"] = "0" * 16
    cfg6.write_text(json.dumps(old_cfg))
    logs.clear()
    export_run(run, log=logs.append)
    assert [("skipped" in m) for m in logs] == [True, True, False]


def test_resume_auto_after_a_stop_rewrites_the_replayed_snapshots(dataset, tmp_path, capsys):
    """A run stopped after its checkpoint at step 3 had written the snapshot of step 4: --resume auto with
    another --lr replays step 4, and its snapshot holds the new weights, not the stopped run's (which is
    set aside in superseded-<time>/)."""
    import shutil
    run = tmp_path / "run"
    flags = ("--save-every", "3", "--snapshot-every-tokens", str(2 * 96))
    assert pretrain(run_flags(run, dataset, 5, *flags), capsys)[0] == 0
    shutil.rmtree(run / "checkpoints" / "step_00000005")  # as if killed before its checkpoint was written
    (run / "checkpoints" / "latest").write_text("step_00000003\n")
    old4 = (run / "snapshots" / "step_00000004" / "model.safetensors").read_bytes()
    rc, out, _ = pretrain(run_flags(run, dataset, 5, *flags, "--lr", "1e-3", "--resume", "auto"), capsys)
    assert rc == 0 and "step_00000003 at step 3" in out
    assert (run / "snapshots" / "step_00000004" / "model.safetensors").read_bytes() != old4
    aside = [p for p in (run / "snapshots").iterdir() if p.name.startswith("superseded-")]
    assert len(aside) == 1 and (aside[0] / "step_00000004" / "model.safetensors").read_bytes() == old4


def test_settings_that_cannot_run_are_refused_at_start(dataset, tmp_path, capsys, monkeypatch):
    """Each refused before the first step with one line naming the setting: model values no model can
    take, an override of the architecture, the Triton kernels without a GPU, --resume given a run directory
    or a snapshot, and a read-only --out."""
    import errno
    run = tmp_path / "run"
    assert pretrain(run_flags(run, dataset, 2, "--snapshot-every-tokens", str(96)), capsys)[0] == 0
    cases = [
        (["--model", "init_std=-1"], "init_std must be a finite number > 0"),
        (["--model", "init_std=nan"], "init_std must be a finite number > 0"),
        (["--model", "rope_base=0", "--arch", "llama"], "rope_base must be a finite number > 0"),
        (["--model", "gate_rank=0"], "gate_rank must be a positive integer"),
        (["--doc-reset", "--arch", "llama"], "LLaMA keeps no state"),
        (["--model", "arch=llama"], "contradicts the architecture tnl; choose the architecture with --arch"),
        (["--resume", str(run)], "a run directory (or its checkpoints/), not one checkpoint"),
        (["--resume", str(run / "snapshots" / "step_00000001")], "a snapshot (the weights, for evaluation)"),
    ]
    for extra, want in cases:
        flags = run_flags(tmp_path / "other", dataset, 1)
        if "--arch" in extra:  # replace the default architecture rather than pass it twice
            i = flags.index("--arch")
            flags[i + 1] = extra[extra.index("--arch") + 1]
            extra = extra[:extra.index("--arch")]
        rc, _, err = pretrain(flags + extra, capsys)
        assert rc == 2 and want in one_error_line(err), (extra, err[-2000:])
    # a run stopped before its first checkpoint, then --resume auto into it with another model
    import shutil
    stopped = tmp_path / "stopped"
    assert pretrain(run_flags(stopped, dataset, 1), capsys)[0] == 0
    shutil.rmtree(stopped / "checkpoints")
    flags = run_flags(stopped, dataset, 1, "--resume", "auto")
    flags[flags.index("--arch") + 1] = "llama"
    rc, _, err = pretrain(flags, capsys)
    assert rc == 2 and "holds no checkpoint yet, but its config.json and metrics are of another model" in err
    assert pretrain(run_flags(stopped, dataset, 1, "--resume", "auto"), capsys)[0] == 0  # the same model: fine
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    rc, _, err = pretrain(run_flags(tmp_path / "t", dataset, 1, "--ops-impl", "triton"), capsys)
    assert rc == 2 and "--ops-impl triton runs the Triton kernels, which need a CUDA GPU" in one_error_line(err)
    monkeypatch.delenv("TRITON_INTERPRET")
    import checkpoints.run_dir as run_dir_module
    real_open = run_dir_module.os.open

    def read_only(path, *args, **kwargs):
        if str(path).endswith(".lock"):
            raise OSError(errno.EROFS, "Read-only file system", str(path))
        return real_open(path, *args, **kwargs)
    monkeypatch.setattr(run_dir_module.os, "open", read_only)
    rc, _, err = pretrain(run_flags(tmp_path / "ro", dataset, 1), capsys)
    assert rc == 2 and "is not writable (Read-only file system); pass --out to a" in one_error_line(err)


def _corrupt(path: Path) -> None:
    target = path / "module" / "model.pt"
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


def test_resume_past_the_limits(dataset, tmp_path, capsys):
    """A resume whose checkpoint already meets --max-steps (or --max-tokens): exit 0, one line saying that
    nothing was trained, where the checkpoint is, the limit, and what to raise; the run is unchanged."""
    run = tmp_path / "run"
    assert pretrain(run_flags(run, dataset, 4, "--save-every", "2"), capsys)[0] == 0
    before = (run / "metrics.jsonl").read_text()
    rc, out, _ = pretrain(run_flags(run, dataset, 3, "--resume", "auto"), capsys)
    assert rc == 0
    lines = [ln for ln in out.splitlines() if "nothing trained" in ln]
    assert lines == ["[linscale] nothing trained: the checkpoint is at step 4 (384 tokens) and --max-steps is 3; "
                     "to train further, raise --max-steps above 4 and run again with --resume auto"], out
    rc, out, _ = pretrain(run_flags(run, dataset, 4, "--resume", "auto"), capsys)  # exactly at the limit
    assert rc == 0 and "nothing trained: the checkpoint is at step 4 (384 tokens) and --max-steps is 4;" in out
    rc, out, _ = pretrain([*run_flags(run, dataset, 9, "--resume", "auto"), "--max-tokens", "300"], capsys)
    assert rc == 0 and "nothing trained: the checkpoint is at step 4 (384 tokens) and --max-tokens is 300; " \
                       "to train further, raise --max-tokens above 384 and run again with --resume auto" in out
    assert (run / "metrics.jsonl").read_text() == before
    assert sorted(x.name for x in (run / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]
    rc, out, _ = pretrain(run_flags(run, dataset, 6, "--resume", "auto"), capsys)  # below the limit: trains
    assert rc == 0 and "nothing trained" not in out and max(losses(run)) == 6


def test_resume_past_the_limits_writes_no_snapshot(dataset, tmp_path, capsys, monkeypatch):
    """With snapshots on, a checkpoint that a signal wrote (so no snapshot of its step) resumed past the
    limits: nothing trained, and no snapshot of a step the run went past written as its "final" one."""
    from pretrain.config import parse_config
    from pretrain.trainer import Trainer
    run = tmp_path / "run"
    flags = ("--snapshot-every-tokens", str(2 * 96), "--snapshot-log-points", "0", "--save-every", "0")
    trainer = Trainer(parse_config(run_flags(run, dataset, 20, *flags)))
    real_step = trainer.module.train_step

    def train_step(micro, step, **kw):
        if step == 4:  # during the 5th step
            os.kill(os.getpid(), signal.SIGUSR1)
        return real_step(micro, step, **kw)

    monkeypatch.setattr(trainer.module, "train_step", train_step)
    assert trainer.fit()["stop"] == "signal"
    snaps = sorted(p.name for p in (run / "snapshots").iterdir())
    assert snaps == ["step_00000002", "step_00000004"]
    rc, out, _ = pretrain(run_flags(run, dataset, 3, *flags, "--resume", "auto"), capsys)
    assert rc == 0 and "nothing trained: the checkpoint is at step 5 (480 tokens) and --max-steps is 3" in out
    assert sorted(p.name for p in (run / "snapshots").iterdir()) == snaps


def run_history(run) -> dict:
    """A run's checkpoints, snapshots and exports by name, and the checkpoint `latest` names."""
    return {sub: sorted(p.name for p in (run / sub).iterdir()) for sub in ("checkpoints", "snapshots", "exports")} \
        | {"latest": (run / "checkpoints" / "latest").read_text()}


def exported_six_step_run(dataset, tmp_path, capsys, save_every: int):
    """A 6-step run checkpointed every `save_every` steps (all kept), snapshotted every 2 steps and
    exported: its directory, its flags, and its history (`run_history`)."""
    from checkpoints.export import export_run
    run = tmp_path / "run"
    flags = ("--save-every", str(save_every), "--keep-last", "0", "--snapshot-every-tokens", str(2 * 96))
    assert pretrain(run_flags(run, dataset, 6, *flags), capsys)[0] == 0
    export_run(run, log=lambda m: None)
    return run, flags, run_history(run)


def test_resume_an_earlier_checkpoint_past_the_limits(dataset, tmp_path, capsys):
    """--resume of an earlier checkpoint of this run that already meets --max-steps: nothing could be
    trained, and the resume would only set the later checkpoints, snapshots and exports aside as an
    abandoned branch. Refused with one line (exit 2), nothing moved; the newest checkpoint past the
    limits has nothing later and only trains nothing (exit 0)."""
    run, flags, before = exported_six_step_run(dataset, tmp_path, capsys, save_every=2)
    step4 = run / "checkpoints" / "step_00000004"
    rc, _, err = pretrain(run_flags(run, dataset, 3, *flags, "--resume", step4), capsys)
    assert rc == 2
    assert one_error_line(err) == (
        f"error: --resume {step4}: the checkpoint is at step 4 (384 tokens) and --max-steps is 3, so nothing would be "
        f"trained from it, while resuming it would set this run's later history (checkpoints/step_00000006, "
        f"snapshots/step_00000006, exports/step_00000006) aside as an abandoned branch; nothing was changed. To train "
        f"on from it, raise --max-steps above 4; to continue the run's newest checkpoint, pass --resume auto")
    assert run_history(run) == before
    rc, _, err = pretrain([*run_flags(run, dataset, 9, *flags, "--resume", step4), "--max-tokens", "384"], capsys)
    assert rc == 2 and "and --max-tokens is 384, so nothing would be trained" in one_error_line(err)
    assert run_history(run) == before
    rc, out, _ = pretrain(run_flags(run, dataset, 6, *flags, "--resume", run / "checkpoints" / "step_00000006"), capsys)
    assert rc == 0 and "nothing trained: the checkpoint is at step 6" in out and run_history(run) == before
    # below the limit the earlier checkpoint is resumed as a new branch, as before
    rc, out, _ = pretrain(run_flags(run, dataset, 5, *flags, "--resume", step4), capsys)
    assert rc == 0 and "nothing trained" not in out
    assert "step_00000005" in run_history(run)["checkpoints"] and "step_00000006" not in run_history(run)["checkpoints"]


def test_resume_auto_in_another_case(dataset, tmp_path, capsys, monkeypatch):
    """`--resume Auto` / `AUTO` (or `resume: AUTO` in --config) is `--resume auto`, not a path; where that
    spelling also names something in the working directory it is ambiguous and refused, naming both ways
    to say it, before anything is written."""
    from pretrain.config import parse_config
    monkeypatch.chdir(tmp_path)
    run = tmp_path / "run"
    assert pretrain(run_flags(run, dataset, 4, "--save-every", "2"), capsys)[0] == 0
    rc, out, err = pretrain(run_flags(run, dataset, 6, "--save-every", "2", "--resume", "AUTO"), capsys)
    assert rc == 0, err
    assert f"resumed from {run / 'checkpoints' / 'step_00000004'} at step 4" in out
    got = losses(run)
    assert sorted(got) == list(range(1, 7)) and all(len(v) == 1 for v in got.values())
    config = tmp_path / "run.yaml"
    config.write_text("resume: Auto\n")
    assert parse_config(["--config", str(config)]).resume == "auto"
    (tmp_path / "Auto").mkdir()
    rc, _, err = pretrain(run_flags(run, dataset, 8, "--save-every", "2", "--resume", "Auto"), capsys)
    assert rc == 2
    assert one_error_line(err) == (
        f"error: --resume Auto: ambiguous: 'auto' in any case means this run's newest complete checkpoint, and Auto "
        f"is also a path here ({(tmp_path / 'Auto').resolve()}); pass --resume auto for the newest checkpoint, or "
        f"--resume ./Auto for that path")
    assert max(losses(run)) == 6
    # `auto` itself stays the keyword
    rc, out, _ = pretrain(run_flags(run, dataset, 8, "--save-every", "2", "--resume", "auto"), capsys)
    assert rc == 0 and "at step 6" in out and max(losses(run)) == 8


def test_resume_with_other_settings(dataset, tmp_path, capsys):
    """A resume with another --seed, --seq-len or --data is refused with one line naming the flag and the
    checkpoint's value, and moves nothing (the later checkpoints, snapshots, exports and `latest` are as
    before); a resume with other flags changed applies them, listing each in one log line."""
    run, flags, before = exported_six_step_run(dataset, tmp_path, capsys, save_every=3)
    step3 = run / "checkpoints" / "step_00000003"
    other_data = make_dataset(tmp_path / "other_data", docs=120, seed=5)
    cases = [
        (run_flags(run, dataset, 6, *flags, "--resume", step3, seed=1),
         f"error: checkpoint {step3} was trained with --seed 0 and this run has --seed 1: ", "resume it with --seed 0"),
        (run_flags(run, dataset, 6, *flags, "--resume", step3, seq_len=32, batch=3),
         f"error: checkpoint {step3} was trained with --seq-len 16 and this run has --seq-len 32: ",
         "resume it with --seq-len 16"),
        (run_flags(run, other_data, 6, *flags, "--resume", step3),
         f"error: checkpoint {step3} (trained on --data {dataset}): ", "fingerprint"),
    ]
    for argv, head, fix in cases:
        rc, _, err = pretrain(argv, capsys)
        line = one_error_line(err)
        assert rc == 2 and line.startswith(head) and fix in line and "another --out" in line, line
        assert run_history(run) == before
    rc, out, _ = pretrain(run_flags(run, dataset, 8, *flags, "--lr", "1e-3", "--weight-decay", "0", "--resume",
                                    "auto", micro=2), capsys)
    assert rc == 0
    lines = [ln for ln in out.splitlines() if "settings changed" in ln]
    assert lines == ["[linscale] settings changed since checkpoint step_00000006, applied from step 7 on: --lr 0.003 "
                     "-> 0.001; --weight-decay 0.1 -> 0.0; --micro-batch 1 -> 2; --max-steps 6 -> 8"], out
    rows = [json.loads(ln) for ln in (run / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["lr"]) for r in rows if r["step"] > 6] == [(7, 1e-3), (8, 1e-3)]


def test_every_checkpoint_corrupt(dataset, tmp_path, capsys):
    """--resume auto with nothing but corrupt checkpoints refuses (exit 2, each one listed with its
    problem, nothing changed); --overwrite then starts from step 0 with them moved aside."""
    run = tmp_path / "run"
    assert pretrain(run_flags(run, dataset, 6, "--save-every", "3", "--keep-last", "0"), capsys)[0] == 0
    for s in (3, 6):
        _corrupt(run / "checkpoints" / f"step_{s:08d}")
    rc, _, err = pretrain(run_flags(run, dataset, 8, "--save-every", "2", "--keep-last", "1", "--resume", "auto"),
                          capsys)
    assert rc == 2
    line = one_error_line(err)
    assert "holds 2 checkpoint(s) and none can be resumed" in line
    assert "step_00000006 is incomplete or corrupt: file module/model.pt does not match" in line
    assert "step_00000003 is incomplete or corrupt" in line and "--overwrite" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["step_00000003", "step_00000006"]
    rc, _, _ = pretrain(run_flags(run, dataset, 8, "--save-every", "2", "--keep-last", "1", "--overwrite"), capsys)
    assert rc == 0
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir()) == ["step_00000008"]


def test_retention_with_corrupt_newer_checkpoints(dataset, tmp_path, capsys):
    """Corrupt checkpoints newer than the one resumed from: retention never deletes the new good ones in
    their favour (it only judges steps up to the one just written, and counts only intact ones)."""
    run = tmp_path / "run"
    assert pretrain(run_flags(run, dataset, 9, "--save-every", "3", "--keep-last", "0"), capsys)[0] == 0
    with open(run / "checkpoints" / "step_00000009" / "module" / "optimizer.pt", "r+b") as f:
        f.truncate(100)
    _corrupt(run / "checkpoints" / "step_00000006")
    rc, out, err = pretrain(run_flags(run, dataset, 5, "--save-every", "1", "--keep-last", "2", "--resume", "auto"),
                            capsys)
    assert rc == 0 and "at step 3" in out
    names = sorted(p.name for p in (run / "checkpoints").iterdir() if p.is_dir())
    assert names == ["step_00000004", "step_00000005", "step_00000006", "step_00000009"]


# ---------------------------------------------------------------------------------------------------
# full disks
# ---------------------------------------------------------------------------------------------------

def _steps_logged(run: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]


def _check_clean_stop(run: Path, line: str, step: int, previous: int, kind: str = "no space left on") -> None:
    from checkpoints import verify
    assert line.startswith(f"error: checkpoint step {step} not written: {kind} "), line
    assert re.search(r"\(needs ~[\d.]+ [KMG]B, [\d.]+ [KMG]?B free\)", line), line
    assert f"step_{previous:08d} is intact" in line and "--resume auto" in line, line
    ckpts = run / "checkpoints"
    assert not list(ckpts.glob("*.tmp")) and not (ckpts / f"step_{step:08d}").exists()
    assert (ckpts / "latest").read_text().strip() == f"step_{previous:08d}"
    assert verify(ckpts / f"step_{previous:08d}") is None
    assert max(_steps_logged(run)) < 12  # training stopped


def test_disk_full_during_save(dataset, tmp_path, capsys, monkeypatch):
    """ENOSPC in the middle of writing a checkpoint (injected into the writer): one line (step, device,
    space needed and free), the partial save removed, training stopped (exit 4), the previous checkpoint
    intact; --resume auto then continues from it (no 'not writable' refusal)."""
    import errno
    import checkpoints.hashio as hashio
    real_write = hashio.HashingFile.write

    def write(self, data):
        if "step_00000004.tmp" in str(self.path) and self.size > 4096:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(self, data)

    monkeypatch.setattr(hashio.HashingFile, "write", write)
    run = tmp_path / "run"
    rc, _, err = pretrain(run_flags(run, dataset, 12, "--save-every", "2", "--keep-last", "0"), capsys)
    assert rc == 4
    line = one_error_line(err)
    _check_clean_stop(run, line, 4, 2)
    assert "the partial save was removed" in line
    monkeypatch.setattr(hashio.HashingFile, "write", real_write)
    rc, out, _ = pretrain(run_flags(run, dataset, 6, "--save-every", "2", "--resume", "auto"), capsys)
    assert rc == 0 and "step_00000002 at step 2" in out


@pytest.fixture
def small_disk(tmp_path):
    """A real 24 MB file system (tmpfs); skipped where mounting is not permitted."""
    mnt = tmp_path / "small_disk"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or 'not root'})")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill(disk: Path, leave: int) -> Path:
    """Write a filler file so that only `leave` bytes stay free on `disk`."""
    import shutil
    filler = disk / "filler.bin"
    free = shutil.disk_usage(disk).free
    with open(filler, "ab") as f:
        f.write(b"\0" * max(0, free - leave))
    return filler


def test_disk_full_on_a_real_file_system(dataset, small_disk, capsys, monkeypatch):
    """The same on a real, small file system: another process fills the disk while a checkpoint is being
    written, so the kernel's ENOSPC hits torch.save mid-file."""
    import checkpoints.markers as markers
    filled = []

    def hook(point, rank):
        if point == "rank_writing" and not filled and (small_disk / "run" / "checkpoints" / "step_00000004.tmp").exists():
            filled.append(_fill(small_disk, 200_000))

    monkeypatch.setattr(markers, "HOOK", hook)
    run = small_disk / "run"
    rc, _, err = pretrain(run_flags(run, dataset, 12, "--save-every", "2", "--keep-last", "0"), capsys)
    assert rc == 4 and filled
    line = one_error_line(err)
    _check_clean_stop(run, line, 4, 2)
    assert f"no space left on {small_disk} (tmpfs, tmpfs)" in line
    filled[0].unlink()
    monkeypatch.setattr(markers, "HOOK", None)
    rc, out, _ = pretrain(run_flags(run, dataset, 6, "--save-every", "2", "--resume", "auto"), capsys)
    assert rc == 0 and "at step 2" in out


def test_save_that_cannot_fit(dataset, tmp_path, small_disk, capsys, monkeypatch):
    """A save that cannot fit in the free space is refused before a byte is written (the size of this
    run's last checkpoint against the free space), with the same one line and exit 4."""
    import checkpoints.markers as markers
    filled = []

    def hook(point, rank):
        if point == "published" and not filled:  # right after step 2's checkpoint: leave ~1 MB
            filled.append(_fill(small_disk, 1_000_000))

    monkeypatch.setattr(markers, "HOOK", hook)
    run = small_disk / "run"
    rc, _, err = pretrain(run_flags(run, dataset, 12, "--save-every", "2", "--keep-last", "0"), capsys)
    assert rc == 4
    line = one_error_line(err)
    _check_clean_stop(run, line, 4, 2, kind="not enough space on")
    assert "partial" not in line  # nothing was written


class _FullAfter:
    """A text file whose writes fail with ENOSPC after `rows` rows, the failing one half-written (as a
    disk that fills up mid-row leaves it)."""

    def __init__(self, f, rows: int):
        self.f, self.rows = f, rows

    def write(self, text: str) -> int:
        import errno
        if self.rows <= 0:
            self.f.write(text[: len(text) // 2])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        self.rows -= 1
        return self.f.write(text)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_disk_full_outside_a_save(dataset, tmp_path, capsys, monkeypatch):
    """The disk fills up while metrics.jsonl is written (between saves): one line naming the file, the
    device and the free space, exit 4, no traceback; training stops at the step boundary without a
    checkpoint of the unlogged steps, so `--resume auto` replays them from the newest checkpoint and
    metrics.jsonl ends up with every step once (the half-written row removed), the replayed losses equal
    to an uninterrupted run's. Any other command's write to a full disk: the same one line, exit 4."""
    import builtins
    import pretrain.metrics as metrics_mod
    from pretrain.errors import run_cli
    ref = tmp_path / "ref"
    assert pretrain(run_flags(ref, dataset, 9, "--save-every", "3"), capsys)[0] == 0

    def full_open(path, mode="r", *a, **k):
        f = builtins.open(path, mode, *a, **k)
        return _FullAfter(f, 4) if str(path).endswith("metrics.jsonl") and "a" in mode else f

    monkeypatch.setattr(metrics_mod, "open", full_open, raising=False)
    run = tmp_path / "run"
    rc, _, err = pretrain(run_flags(run, dataset, 9, "--save-every", "3"), capsys)
    assert rc == 4
    line = one_error_line(err)
    assert line.startswith(f"error: {run / 'metrics.jsonl'}: a row could not be written: no space left on "), line
    assert re.search(r"\([\d.]+ [KMGT]?B free\)", line) and "stopped at step 5" in line, line
    assert "newest checkpoint step_00000003" in line and "--resume auto" in line, line
    ckpts = run / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_00000003"]  # none of the unlogged step 5
    assert not (run / "metrics.jsonl").read_text().endswith("\n")  # the half-written row of step 5
    monkeypatch.undo()
    rc, out, err = pretrain(run_flags(run, dataset, 9, "--save-every", "3", "--resume", "auto"), capsys)
    assert rc == 0 and "step_00000003 at step 3" in out and "removed a half-written last row" in err
    got, want = losses(run), losses(ref)
    assert sorted(got) == list(range(1, 10))
    assert all(v == want[s][0] for s, vs in got.items() for v in vs)  # replayed steps: the same losses

    def writes_to_a_full_disk(argv):
        import errno
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "out.bin"))

    assert run_cli(writes_to_a_full_disk, [], prog="prepare_data") == 4
    line = one_error_line(capsys.readouterr().err)
    assert line.startswith(f"prepare_data: error: {tmp_path / 'out.bin'}: cannot write: no space left on "), line


# ---------------------------------------------------------------------------------------------------
# Ctrl-C
# ---------------------------------------------------------------------------------------------------

def _terminal_sigint() -> None:
    """In the child before exec: SIGINT at its default, as in a terminal's foreground job. A test run in the
    background (`cmd &`, nohup) inherits SIGINT ignored, and Python then installs no Ctrl-C handler at all."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(flags: list, script: str | None = None) -> subprocess.Popen:
    cmd = [sys.executable, "-c", script] if script else [sys.executable, str(ROOT / "launch" / "pretrain.py")]
    return subprocess.Popen([*cmd, *map(str, flags)], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, preexec_fn=_terminal_sigint)


def _wait_for_torch_import(proc: subprocess.Popen) -> None:
    """Until the child is importing torch: inside launch/pretrain.py's own code, past interpreter start-up
    and site's .pth files (a Ctrl-C there is Python's, not ours, and a loaded machine can spend seconds
    there)."""
    maps = Path(f"/proc/{proc.pid}/maps")
    deadline = time.monotonic() + 120
    while maps.exists() and time.monotonic() < deadline and proc.poll() is None:
        try:
            if "libtorch" in maps.read_text():
                return
        except OSError:
            pass
        time.sleep(0.01)
    if not maps.exists():
        time.sleep(0.5)


def _wait_for_step(proc: subprocess.Popen, run: Path, step: int) -> None:
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and proc.poll() is None:
        m = run / "metrics.jsonl"
        if m.exists() and any(json.loads(x)["step"] >= step for x in m.read_text().splitlines()):
            return
        time.sleep(0.01)
    raise AssertionError(f"never reached step {step}: {proc.communicate()}")


def test_ctrl_c_stops_with_a_checkpoint(dataset, tmp_path):
    """Ctrl-C (SIGINT) is a graceful stop, as SIGTERM: the step finishes, a checkpoint of it is written,
    exit 0; nothing since the last periodic checkpoint is lost and --resume auto continues."""
    run = tmp_path / "run"
    proc = _start(run_flags(run, dataset, 500, "--save-every", "100"))
    _wait_for_step(proc, run, 3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "received Ctrl-C: stopping after this step and writing a checkpoint" in err
    summary = json.loads((run / "summary.json").read_text())
    assert summary["stop"] == "signal"
    stopped = summary["step"]
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:08d}"
    assert max(_steps_logged(run)) == stopped


def test_ctrl_c_under_torchrun(dataset, tmp_path):
    """Ctrl-C in the terminal of a 2-rank torchrun job (gloo on CPU): the terminal signals torchrun's process
    group, torchrun forwards SIGINT to each rank (each rank leads a process group of its own, so each gets it once);
    every rank finishes the step, the ranks write one checkpoint of it together and exit without a
    traceback; torchrun returns within its 30 s grace (no hang). torchrun itself then reports the signal
    in its own way (a SignalException, exit 1), which is torchrun's, not a rank's."""
    from checkpoints import verify
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--tee", "3",
           "--master_port", str(free_port()), str(ROOT / "launch" / "pretrain.py"),
           *map(str, run_flags(run, dataset, 500, "--save-every", "100", "--backend", "gloo"))]
    proc = subprocess.Popen(cmd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            start_new_session=True, preexec_fn=_terminal_sigint)  # a terminal's job
    try:
        _wait_for_step(proc, run, 2)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = out + err
    for rank in (0, 1):
        mine = "\n".join(ln for ln in text.splitlines() if ln.startswith(f"[default{rank}]:"))
        assert mine.count("received Ctrl-C: stopping after this step and writing a checkpoint") == 1, text[-4000:]
        assert "Traceback" not in mine and "second Ctrl-C" not in mine and "Error" not in mine, mine[-3000:]
    assert "Unable to shutdown process" not in text  # no rank had to be killed after the grace period
    summary = json.loads((run / "summary.json").read_text())
    stopped = summary["step"]
    assert summary["stop"] == "signal" and stopped >= 2
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == f"step_{stopped:08d}"
    assert verify(ckpts / f"step_{stopped:08d}") is None and not list(ckpts.glob("*.tmp"))
    assert max(_steps_logged(run)) == stopped


SLOW_SAVE = """
import sys, time
sys.path.insert(0, {root!r})
import checkpoints.markers as markers
def hook(point, rank):
    if point == "rank_writing":
        time.sleep(30)  # a long save: the second Ctrl-C arrives while it is being written
markers.HOOK = hook
from pretrain.trainer import main
sys.exit(main(sys.argv[1:]))
"""


def test_second_ctrl_c_exits_at_once(dataset, tmp_path):
    """A second Ctrl-C while the stop's checkpoint is being written exits at once (exit 130, no
    traceback); the partial save is never loaded and the next start removes it."""
    run = tmp_path / "run"
    proc = _start(run_flags(run, dataset, 500, "--save-every", "0"), SLOW_SAVE.format(root=str(ROOT)))
    _wait_for_step(proc, run, 2)
    proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + 60
    while not list((run / "checkpoints").glob("*.tmp")) and time.monotonic() < deadline:
        time.sleep(0.01)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - t0 < 10
    assert "Traceback" not in err and "second Ctrl-C: exiting now" in err
    rc = subprocess.run([sys.executable, str(ROOT / "launch" / "pretrain.py"),
                         *map(str, run_flags(run, dataset, 3, "--resume", "auto"))], env=env(), capture_output=True,
                        text=True, cwd=ROOT)
    assert rc.returncode == 0 and "removed" in rc.stdout and ".tmp (a save that never finished)" in rc.stdout


SLOW_FIRST_SAVE = """
import sys, time
sys.path.insert(0, {root!r})
import checkpoints.markers as markers
slow = [True]
def hook(point, rank):
    if point == "rank_writing" and slow:
        slow.clear()
        time.sleep(3)  # the first periodic save is still being written when the signal arrives
markers.HOOK = hook
from pretrain.trainer import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_during_a_save(dataset, tmp_path, sig):
    """SIGTERM (Slurm's warning) or one Ctrl-C while a periodic checkpoint is being written in the
    background: that save completes, training stops at the step boundary with a checkpoint of its own
    step, exit 0; both checkpoints verify and --resume auto continues from the second."""
    from checkpoints import verify
    run = tmp_path / "run"
    proc = _start(run_flags(run, dataset, 500, "--save-every", "3"), SLOW_FIRST_SAVE.format(root=str(ROOT)))
    deadline = time.monotonic() + 120
    while not (run / "checkpoints" / "step_00000003.tmp").exists() and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    stopped = json.loads((run / "summary.json").read_text())
    assert stopped["stop"] == "signal" and stopped["step"] >= 3
    ckpts = run / "checkpoints"
    assert not list(ckpts.glob("*.tmp"))
    assert verify(ckpts / "step_00000003") is None
    assert verify(ckpts / f"step_{stopped['step']:08d}") is None
    assert (ckpts / "latest").read_text().strip() == f"step_{stopped['step']:08d}"
    assert max(_steps_logged(run)) == stopped["step"]
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "pretrain.py"),
                           *map(str, run_flags(run, dataset, stopped["step"] + 1, "--resume", "auto"))],
                          env=env(), capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert proc.returncode == 0 and f"at step {stopped['step']}," in proc.stdout, proc.stderr[-2000:]


def test_ctrl_c_during_startup(dataset, tmp_path, capsys, monkeypatch):
    """Ctrl-C before training starts (importing, building the model): 'interrupted', exit 130, no
    traceback, and the run directory is not left locked."""
    proc = _start(["--out", tmp_path / "run", "--max-steps", "5"])
    _wait_for_torch_import(proc)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "interrupted" in err
    # after the run directory is locked (while the model is built), in this process
    import pretrain.trainer as trainer_mod

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_mod, "build_from_config", interrupted)
    run = tmp_path / "run2"
    rc, _, err = pretrain(run_flags(run, dataset, 3), capsys)
    assert rc == 130 and "interrupted" in err and "Traceback" not in err
    from checkpoints.run_dir import RunLock
    RunLock(run).acquire().release()  # not left locked


def test_rank_aborts_at_exit_after_finishing(dataset, tmp_path):
    """A process that aborts as its interpreter exits, after the run finished: summary.json and the final
    checkpoint are complete on disk, and attempt_result.py (what pretrain.sbatch reads to end such a job
    COMPLETED) reports the run finished at the step of its newest complete checkpoint. The script's side
    runs on a real Slurm in tests/test_slurm.py (scenario abort_at_exit)."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text("ABORT_HERE = True\n" + ABORT_AT_EXIT_HOOK)
    e = env()
    e["PYTHONPATH"] = str(hook) + os.pathsep + e["PYTHONPATH"]
    run = tmp_path / "run"
    p = subprocess.run(pretrain_cmd(run_flags(run, dataset, 4)), env=e, capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGABRT, p.stderr[-2000:]
    assert "'stop': 'finished'" in p.stdout + p.stderr
    got = subprocess.run([sys.executable, str(ROOT / "launch" / "slurm" / "attempt_result.py"), str(run)],
                         capture_output=True, text=True, timeout=60, check=True).stdout.split()
    assert got == ["4", "finished", "4"]
    from checkpoints.manifest import verify
    assert verify(run / "checkpoints" / "step_00000004") is None  # checksums too


# ---------------------------------------------------------------------------------------------------
# damaged and odd input data (prepare_data, and streaming training from the same config)
# ---------------------------------------------------------------------------------------------------

def _records(n: int, seed: int = 0) -> list[str]:
    """n distinct documents of varied words (compresses like text: several zstd blocks for a few hundred)."""
    import random
    rng = random.Random(seed)
    words = ("river mill wheat bread flour stone water wind field harvest morning evening village road "
             "market winter summer bridge tower garden").split()
    return [f"Document {i} " + " ".join(rng.choice(words) + str(rng.randrange(1000)) for _ in range(120))
            for i in range(n)]


def _jsonl(docs: list[str]) -> bytes:
    return b"".join(json.dumps({"text": d}).encode() + b"\n" for d in docs)


def _read(path: Path, kind: str = "jsonl") -> tuple[list[str], dict, str]:
    """Every document the source reader keeps from one file, what it counted, and its warnings."""
    import io
    import logging
    from data_pipeline.config import SourceConfig
    from data_pipeline.sources import Counts, iter_file
    src = SourceConfig(name="s", language="en", type=kind, paths=[str(path)])
    counts = Counts("s")
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logger = logging.getLogger("linscale.data")
    logger.addHandler(handler)
    try:
        docs = [t for t, _ in iter_file(src, path, counts, 1 << 24)]
    finally:
        logger.removeHandler(handler)
    return docs, dict(counts.skipped), buf.getvalue()


def _prepare(tmp_path: Path, paths: list[str], kind: str = "jsonl") -> tuple[int, dict, str]:
    """launch/prepare_data.py's main on one source: (exit code, stats.json or {}, stderr)."""
    import contextlib
    import io
    from launch.prepare_data import main
    cfg = tmp_path / "data.yaml"
    # _records() writes word salad without function words: the stop-word filter is not what these tests test
    filters = {"min_chars": 10, "min_stop_share": 0}
    cfg.write_text(json.dumps({"name": "t", "val_fraction": 0, "dedup": {"near": False}, "filters": filters,
                               "sources": [{"name": "s", "language": "en", "type": kind, "paths": paths}]}))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["--config", str(cfg), "--out", str(tmp_path / "ds"), "--workers", "1", "--no-progress"])
    stats = tmp_path / "ds" / "stats.json"
    return rc, json.loads(stats.read_text()) if stats.exists() else {}, err.getvalue()


def test_corrupt_zst(tmp_path):
    """A .zst with damaged bytes in the middle: prepare (and streaming) keep every document of the blocks
    before the damage and count the file once under damaged_files, with its name; no ZstdError."""
    import zstandard
    docs = _records(600)
    blob = bytearray(zstandard.ZstdCompressor(level=3).compress(_jsonl(docs)))
    blob[len(blob) * 2 // 3] ^= 0xFF
    blob[len(blob) * 2 // 3 + 1] ^= 0x5A
    (tmp_path / "a.jsonl.zst").write_bytes(bytes(blob))
    (tmp_path / "b.jsonl").write_bytes(_jsonl(["An intact neighbour file with a document of its own."]))
    kept, counts, log = _read(tmp_path / "a.jsonl.zst")
    assert 100 < len(kept) < 600 and kept == docs[:len(kept)]
    assert counts == {"damaged_files": 1} and "a.jsonl.zst" in log and "zstd stream corrupt" in log
    rc, stats, err = _prepare(tmp_path, [str(tmp_path / "*.jsonl*")])
    assert rc == 0 and "Traceback" not in err
    src = stats["sources"][0]
    assert src["skipped_input"] == {"damaged_files": 1} and src["documents_in"] == len(kept) + 1
    from data_pipeline import build_loader
    cfg = tmp_path / "data.yaml"
    batch = build_loader(str(cfg), 32, 2, 2).next_batch()  # streaming training reads it too
    assert batch["input_ids"].shape == (2, 32)


@pytest.mark.parametrize("codec", ["zst", "gz", "bz2", "xz"])
def test_truncated_compressed_file(tmp_path, codec):
    """A compressed file cut short, for every compression the sources read: exactly the documents that the
    codec's own one-shot decoder recovers from the cut file are kept (a small file's too), the file is
    counted under damaged_files, the cut record is dropped; concatenated streams are all read."""
    import bz2
    import gzip
    import lzma
    import zlib
    import zstandard
    compress = {"zst": lambda b: zstandard.ZstdCompressor().compress(b), "gz": gzip.compress,
                "bz2": bz2.compress, "xz": lambda b: lzma.compress(b, preset=1)}[codec]
    decoder = {"zst": lambda: zstandard.ZstdDecompressor().decompressobj(), "gz": lambda: zlib.decompressobj(31),
               "bz2": bz2.BZ2Decompressor, "xz": lzma.LZMADecompressor}[codec]
    for n, cut in ((200, 0.97), (2000, 0.6)):
        docs = _records(n, seed=n)
        path = tmp_path / f"d{n}.jsonl.{codec}"
        blob = compress(_jsonl(docs))
        path.write_bytes(blob[:int(len(blob) * cut)])
        recoverable = decoder().decompress(blob[:int(len(blob) * cut)]).count(b"\n")  # complete records
        kept, counts, log = _read(path)
        assert kept == docs[:recoverable], (n, len(kept), recoverable)
        assert counts == {"damaged_files": 1}, (n, counts)
        assert "truncated" in log and path.name in log and f"the {len(kept)} document(s) before the damage" in log
        if n == 2000 or codec in ("gz", "xz"):  # zstd and bzip2 decode whole blocks: a small cut file keeps none
            assert len(kept) > n * cut * 0.5
    intact = tmp_path / f"whole.jsonl.{codec}"
    intact.write_bytes(compress(_jsonl(docs)) + compress(_jsonl(["a second stream, concatenated"])))
    kept, counts, _ = _read(intact)
    assert kept == docs + ["a second stream, concatenated"] and counts == {}


def test_lone_surrogate_record(tmp_path):
    """A JSON record with an escaped lone surrogate ("\\ud800") is skipped and counted with its file and
    line; the records around it are kept and prepare finishes."""
    good = _records(3)
    (tmp_path / "a.jsonl").write_bytes(_jsonl(good[:1]) + b'{"text": "half a pair \\ud800 here"}\n' + _jsonl(good[1:]))
    kept, counts, log = _read(tmp_path / "a.jsonl")
    assert kept == good and counts == {"invalid_unicode_records": 1} and "a.jsonl:2" in log
    rc, stats, err = _prepare(tmp_path, [str(tmp_path / "a.jsonl")])
    assert rc == 0 and stats["sources"][0]["skipped_input"] == {"invalid_unicode_records": 1}


def test_one_line_in_another_encoding(tmp_path):
    """One GBK-encoded line in a small UTF-8 jsonl: that line is skipped and counted, the good documents
    around it kept (the file is not called binary); a file with no UTF-8 line at all is."""
    good = ["第一篇文档，用 UTF-8 写成。", "The second document, in plain ASCII."]
    gbk = json.dumps({"text": "第二篇文档用 GBK 编码"}, ensure_ascii=False).encode("gbk")
    (tmp_path / "a.jsonl").write_bytes(_jsonl(good[:1]) + gbk + b"\n" + _jsonl(good[1:]))
    kept, counts, _ = _read(tmp_path / "a.jsonl")
    assert kept == good and counts == {"invalid_utf8_lines": 1}
    (tmp_path / "b.jsonl").write_bytes(b"\n".join([gbk] * 20))
    assert _read(tmp_path / "b.jsonl")[1] == {"binary_files": 1}


def test_utf8_byte_order_mark(tmp_path):
    """A UTF-8 BOM at the start of a file (jsonl, text, compressed or not) is dropped, not the first record."""
    import gzip
    docs = _records(3)
    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + _jsonl(docs))
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(b"\xef\xbb\xbf" + _jsonl(docs)))
    for name in ("a.jsonl", "b.jsonl.gz"):
        kept, counts, _ = _read(tmp_path / name)
        assert kept == docs and counts == {}
    (tmp_path / "c.txt").write_bytes("\ufeffA whole-file text document.".encode())
    assert _read(tmp_path / "c.txt", kind="text")[0] == ["A whole-file text document."]


def test_document_far_over_max_chars(tmp_path):
    """A text file read whole (text_unit: file) far over filters.max_chars is not held (the reader stops
    keeping it at twice max_chars) and is counted as overlong_documents, warned about with the fix; the
    other files' documents are kept."""
    import contextlib
    import io
    from launch.prepare_data import main
    good = _records(3)
    for i, d in enumerate(good):
        (tmp_path / f"good{i}.txt").write_text(d)
    (tmp_path / "big.txt").write_text("\n".join(_records(200, seed=1)))     # ~170k characters, one document
    cfg = tmp_path / "data.yaml"
    cfg.write_text(json.dumps({"name": "t", "val_fraction": 0, "dedup": {"near": False},
                               "filters": {"min_chars": 10, "min_stop_share": 0, "max_chars": 20000},
                               "sources": [{"name": "s", "language": "en", "type": "text",
                                            "paths": [str(tmp_path / "*.txt")]}]}))
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["--config", str(cfg), "--out", str(tmp_path / "ds"), "--workers", "1", "--no-progress"])
    assert rc == 0, err.getvalue()
    stats = json.loads((tmp_path / "ds" / "stats.json").read_text())["sources"][0]
    assert stats["skipped_input"] == {"overlong_documents": 1}, stats
    assert stats["documents_in"] == 3
    assert "big.txt" in err.getvalue() and "text_unit: blank_line or line" in err.getvalue()


def test_inputs_all_skipped(tmp_path):
    """A plain text file configured as `type: jsonl`: every line is skipped as input, so the dataset is empty;
    the error names the skip reason and the source's type/field, not the filters, which removed nothing."""
    (tmp_path / "notes.jsonl").write_text("\n".join(_records(5)) + "\n")
    rc, _, err = _prepare(tmp_path, [str(tmp_path / "notes.jsonl")])
    assert rc == 2
    line = one_error_line(err)
    assert "the inputs held no documents (skipped input (bad_json_lines): 5)" in line, line
    assert "`type`" in line and "`filters:`" not in line


def test_output_piped_into_head():
    """A command whose output is cut off by its reader (`model_info.py ... | head -1`, a long table into
    `head`): it stops quietly with the shell's SIGPIPE status, no BrokenPipeError traceback."""
    code = ("import sys; from pretrain.errors import run_cli\n"
            "def main(argv):\n    for i in range(200000):\n        print(f'row {i} ' + 'x' * 60)\n"
            "sys.exit(run_cli(main))")
    p = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    assert p.stdout.readline().startswith(b"row 0 ")
    p.stdout.close()            # what head does after its first line
    err = p.stderr.read().decode()
    assert p.wait(timeout=60) == 141, err
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_data_globs_match_nothing(tmp_path, dataset, capsys):
    """A data config whose paths match no file: prepare_data and training refuse (exit 2, naming the
    source, the patterns and the folder they are read from) instead of an empty dataset."""
    rc, stats, err = _prepare(tmp_path, ["nothing/*.jsonl", "also_missing.jsonl.gz"])
    assert rc == 2 and not stats
    line = one_error_line(err)
    assert "no input file matches for source 's'" in line and "nothing/*.jsonl" in line
    assert f"read from the config's folder, {tmp_path}" in line
    rc, _, err = pretrain(["--data", tmp_path / "data.yaml", "--out", tmp_path / "run", "--max-steps", "1"], capsys)
    assert rc == 2 and "no input file matches" in one_error_line(err)
    (tmp_path / "corpus").mkdir()  # a folder given as a path matches no file: the message says to glob its files
    (tmp_path / "corpus" / "a.jsonl").write_bytes(_jsonl(_records(2)))
    rc, stats, err = _prepare(tmp_path, [str(tmp_path / "corpus")])
    line = one_error_line(err)
    assert rc == 2 and f"{tmp_path / 'corpus'}: it is a folder; give its files with a glob, e.g. " \
                       f"{tmp_path / 'corpus' / '*.jsonl'}" in line, line


def test_data_config_missing_or_a_folder(tmp_path, capsys):
    """A data config path that does not exist, or a folder named *.yaml: prepare_data and training end in one
    line naming the path and what is wrong (where relative paths are read from), exit 2, nothing written."""
    from launch.prepare_data import main
    (tmp_path / "d.yaml").mkdir()
    for cfg, expect in ((tmp_path / "missing.yaml", f"error: data config {tmp_path / 'missing.yaml'} not found "
                                                    f"(relative paths are read from the working directory, "),
                        (tmp_path / "d.yaml", f"error: data config {tmp_path / 'd.yaml'} is a folder, not a YAML file")):
        rc, err = in_process(main, ["--config", cfg, "--out", tmp_path / "ds", "--no-progress"], capsys)
        assert rc == 2 and expect in one_error_line(err), err
        rc, _, err = pretrain(["--data", cfg, "--out", tmp_path / "run", "--max-steps", "1"], capsys)
        assert rc == 2 and expect in one_error_line(err), err
    assert not (tmp_path / "ds").exists() and not (tmp_path / "run" / "checkpoints").exists()


def test_data_config_mix_beside_weights(tmp_path, capsys):
    """`mix` beside a `weight` on every source (a 2:1 mix the weights' 1:1 would silently replace): refused
    when the config is read, by prepare_data and by training, one line naming both keys and the fix."""
    from launch.prepare_data import main
    (tmp_path / "a.jsonl").write_bytes(_jsonl(_records(3)))
    cfg = tmp_path / "data.yaml"
    cfg.write_text(json.dumps({"mix": {"en": 2, "zh": 1}, "sources": [
        {"name": "a", "language": "en", "type": "jsonl", "paths": ["a.jsonl"], "weight": 1},
        {"name": "b", "language": "zh", "type": "jsonl", "paths": ["a.jsonl"], "weight": 1}]}))
    want = "both `mix` and every source's `weight` are given, and with a weight on every source `mix` is not used; remove `mix`"
    rc, err = in_process(main, ["--config", cfg, "--out", tmp_path / "ds", "--workers", "1", "--no-progress"], capsys)
    assert rc == 2 and f"error: {cfg}: {want}" in one_error_line(err), err
    assert not (tmp_path / "ds").exists()
    rc, _, err = pretrain(["--data", cfg, "--out", tmp_path / "run", "--max-steps", "1"], capsys)
    assert rc == 2 and want in one_error_line(err), err


def test_empty_input_files(tmp_path):
    """Files holding no document (0 bytes, a .gz of nothing, only blank lines) among good ones: each counted
    once under empty_files and warned about by name; none read as a document (documents_in counts the good
    files only, nothing removed as too_short); prepare finishes."""
    import gzip
    docs = _records(2)
    (tmp_path / "good0.txt").write_text(docs[0])
    (tmp_path / "good1.txt").write_text(docs[1])
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "empty.txt.gz").write_bytes(gzip.compress(b""))
    (tmp_path / "blank.txt").write_bytes(b"\n \r\n\t\n")
    rc, stats, err = _prepare(tmp_path, [str(tmp_path / "*.txt*")], kind="text")
    assert rc == 0, err
    src = stats["sources"][0]
    assert src["skipped_input"] == {"empty_files": 3}, src
    assert src["documents_in"] == 2 and not sum(src["removed_by_filter"].values())
    assert sum(src["documents_out"].values()) == 2
    for name in ("empty.txt", "empty.txt.gz", "blank.txt"):
        assert f"skipped empty files at {tmp_path / name}" in err, err


def test_file_in_windows_1252(tmp_path):
    """An English file saved as Windows-1252 among UTF-8 files: its lines with curly quotes and dashes are
    skipped and counted, and one warning for that file names Windows-1252 and `iconv -f cp1252 -t utf-8`,
    whose codec gives the text back exactly; the UTF-8 file with the same characters gets no hint."""
    docs = _records(6, seed=3)
    text = "\n".join(f"\u201c{d[:300]}\u201d \u2013 {d[300:]}" if i % 2 else d for i, d in enumerate(docs))
    (tmp_path / "a_1252.txt").write_bytes(text.encode("cp1252"))
    (tmp_path / "b_utf8.txt").write_text(text, encoding="utf-8")
    rc, stats, err = _prepare(tmp_path, [str(tmp_path / "*.txt")], kind="text")
    assert rc == 0, err
    assert stats["sources"][0]["skipped_input"] == {"invalid_utf8_lines": 3}
    hints = [ln for ln in err.splitlines() if "iconv" in ln]
    assert len(hints) == 1 and str(tmp_path / "a_1252.txt") in hints[0], err
    assert "3 line(s) not UTF-8, skipped; they read as Windows-1252" in hints[0]
    assert "convert the file (iconv -f cp1252 -t utf-8)" in hints[0]
    codec = hints[0].split("iconv -f ")[1].split(" ")[0]
    assert (tmp_path / "a_1252.txt").read_bytes().decode(codec) == text


def test_prepare_bad_part_flags(tmp_path, capsys):
    """prepare_data --num-parts 0, a --part outside the parts, negative --workers, a negative --task or one
    without --merge-stage: usage error, exit 2."""
    cfg = tmp_path / "d.yaml"
    cfg.write_text("sources: [{name: s, language: en, type: jsonl, paths: [x.jsonl]}]\n")
    from launch.prepare_data import main
    for args, expect in ((["--num-parts", "0"], "--num-parts 0: out of range; allowed: >= 1"),
                         (["--num-parts", "2", "--part", "2"], "--part 2: out of range; allowed: 0 to 1"),
                         (["--workers", "-1"], "--workers -1: out of range"),
                         (["--task", "-1"], "argument --task: -1: out of range; allowed: >= 0"),
                         (["--task", "3"], "--task goes with --merge-stage")):
        rc, err = in_process(main, ["--config", cfg, "--out", tmp_path / "o", *args], capsys)
        assert rc == 2 and expect in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists()


def test_prepare_keeps_nothing(tmp_path, capsys):
    """Every document removed by the filters: prepare_data exits 2 naming the filters that removed them
    (never 0 with an empty dataset); one source of two left empty: a warning naming it."""
    import random
    rng = random.Random(0)
    nouns = "river mill village baker teacher garden letter bridge harvest winter market station".split()
    verbs = "watched crossed painted carried found opened remembered followed described visited".split()
    docs = [" ".join(f"The {rng.choice(nouns)} {rng.choice(verbs)} the {rng.choice(nouns)} of {w}, and it was "
                     f"there that we {rng.choice(verbs)} a {rng.choice(nouns)} for the {rng.choice(nouns)}."
                     for w in rng.sample(range(10000), 12)) for _ in range(6)]
    (tmp_path / "good.jsonl").write_bytes(_jsonl(docs))
    (tmp_path / "tiny.jsonl").write_bytes(_jsonl(["too short"] * 5))
    rc, stats, err = _prepare(tmp_path, [str(tmp_path / "tiny.jsonl")])
    assert rc == 2, err
    line = one_error_line(err)
    assert "holds no tokens: of 5 documents read, removed by filter too_short: 5" in line, line
    assert "`filters:`" in line
    cfg = tmp_path / "two.yaml"
    cfg.write_text(json.dumps({"name": "t", "val_fraction": 0, "dedup": {"near": False},
                               "filters": {"min_chars": 10, "min_word_variety": 0},
                               "sources": [{"name": "good", "language": "en", "type": "jsonl",
                                            "paths": [str(tmp_path / "good.jsonl")], "weight": 1},
                                           {"name": "tiny", "language": "en", "type": "jsonl",
                                            "paths": [str(tmp_path / "tiny.jsonl")], "weight": 1}]}))
    import contextlib
    import io
    from launch.prepare_data import main
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["--config", str(cfg), "--out", str(tmp_path / "ds2"), "--workers", "1", "--no-progress"])
    assert rc == 0 and "source 'tiny' contributed no tokens: of 5 documents read, removed by filter too_short: 5" \
        in err.getvalue(), err.getvalue()


def test_prepare_out_inside_its_inputs(tmp_path, capsys):
    """A data config whose globs match, or once written would match, what prepare_data writes into --out
    (`<dir>/**/*` with --out inside <dir>; a `*.bin` reaching the token files, also relative with `./`,
    through a symlinked folder, or with a character class): one line naming the source, its pattern and
    --out, exit 2, nothing written. A narrow glob (`<dir>/*.jsonl`) beside --out prepares, a second time too."""
    from launch.prepare_data import main
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.jsonl").write_bytes(_jsonl(_records(4)))
    (data / "b.bin").write_text(_records(1)[0])
    (tmp_path / "alias").symlink_to(data, target_is_directory=True)
    out = data / "ds"

    def prepare(kind: str, pattern: str) -> tuple[int, str]:
        cfg = tmp_path / "data.yaml"  # relative patterns are read from here
        cfg.write_text(json.dumps({"name": "t", "val_fraction": 0, "dedup": {"near": False},
                                   "filters": {"min_chars": 10, "min_stop_share": 0},
                                   "sources": [{"name": "s", "language": "en", "type": kind, "paths": [pattern]}]}))
        return in_process(main, ["--config", cfg, "--out", out, "--workers", "1", "--no-progress"], capsys)

    for kind, pattern in (("jsonl", str(data / "**" / "*")), ("text", str(data / "**" / "*.bin")),
                          ("text", "./data/*/*/*/*.bin"), ("text", "alias/**/*.bin"),
                          ("text", "data/*/tokens/[a-z]/*.bin")):
        rc, err = prepare(kind, pattern)
        assert rc == 2, (pattern, err)
        line = one_error_line(err)
        assert f"source 's' ({pattern!r}) match files that prepare writes into --out {out}" in line, line
        assert "give an --out outside the inputs' globs, or narrow the globs" in line
        assert not out.exists(), pattern
    for _ in range(2):
        rc, err = prepare("jsonl", str(data / "*.jsonl"))
        assert rc == 0 and "Traceback" not in err, err
        assert (out / "train" / "meta.json").is_file()


def test_out_is_a_file(dataset, tmp_path, capsys):
    """--out naming a file (or a path under one): one line saying which path is a file, exit 2. A file
    where the run's checkpoints/ or snapshots/ go is refused the same way before the first step (found by
    the first save, it cost every step trained before it)."""
    f = tmp_path / "a_file"
    f.write_text("x")
    rc, _, err = pretrain(run_flags(f / "run", dataset, 1), capsys)
    assert rc == 2 and f"({f} is a file, not a directory)" in one_error_line(err)
    for sub in ("checkpoints", "snapshots"):
        run = tmp_path / f"run_{sub}"
        run.mkdir()
        (run / sub).write_text("x")
        rc, _, err = pretrain(run_flags(run, dataset, 2, "--save-every", "0"), capsys)
        assert rc == 2 and f"{run / sub} is a file, not a directory" in one_error_line(err)
        assert not (run / "metrics.jsonl").exists()  # nothing trained
    from launch.prepare_data import main
    cfg = tmp_path / "d.yaml"
    cfg.write_text("sources: [{name: s, language: en, type: jsonl, paths: [x.jsonl]}]\n")
    rc, err = in_process(main, ["--config", cfg, "--out", f], capsys)
    assert rc == 2 and f"--out {f}: a file, not a folder" in err and "Traceback" not in err, err


def test_fit_scaling_bad_numbers(capsys):
    """fit_scaling's numeric flags outside their ranges: the usage error naming the flag, exit 2."""
    from launch.fit_scaling import main
    for args, expect in ((["--n-boot", "-1"], "argument --n-boot: -1: out of range; allowed: >= 0"),
                         (["--points-per-decade", "0"], "argument --points-per-decade: 0: out of range; allowed: >= 1"),
                         (["--points-per-decade", "1001"],
                          "argument --points-per-decade: 1001: out of range; allowed: >= 1 and <= 1000: a grid finer "
                          "than 1000 points per decade"),
                         (["--points-per-decade", "1000000000"], "every grid point costs memory per run and bootstrap "
                                                                 "replicate"),
                         (["--min-runs", "0"], "argument --min-runs: 0: out of range"),
                         (["--smooth", "-0.1"], "argument --smooth: -0.1: out of range; allowed: >= 0"),
                         (["--c-min", "nan"], "argument --c-min: nan: not a finite number"),
                         (["--block", "x"], "argument --block: expected an integer >= 1, got 'x'")):
        rc, err = in_process(main, ["runs", *args], capsys)
        assert rc == 2 and expect in err and "Traceback" not in err, (args, err)


# ---------------------------------------------------------------------------------------------------
# checkpoints, models and the other commands
# ---------------------------------------------------------------------------------------------------

def test_fit_scaling_run_without_a_loss_log(tmp_path, capsys):
    """A run of a folder of runs without a usable loss log (an empty metrics.jsonl, rows of another loss, no log
    at all): one line naming the run, what is wrong and the fix; with --skip-bad the others are fitted."""
    from launch.fit_scaling import main
    from models.sizes import model_config
    from scaling.synthetic import LossLaw, write_run
    runs = tmp_path / "runs"
    for size in ("l1d32", "l1d64", "l1d96"):
        write_run(runs / f"tnl-{size}", model_config("tnl", size), LossLaw(), 3e8, n_rows=40)
    log = runs / "tnl-l1d96" / "metrics.jsonl"
    rows = [json.loads(x) for x in log.read_text().splitlines()]
    log.write_text("")
    rc, err = in_process(main, [runs, "--n-boot", "0"], capsys)
    assert rc == 2 and f"{runs / 'tnl-l1d96'}: no usable rows in metrics.jsonl: it holds no rows" in \
        one_error_line(err) and "--skip-bad" in err, err
    log.write_text("".join(json.dumps({**{k: v for k, v in r.items() if k != "loss"}, "val_loss": r["loss"]}) + "\n"
                           for r in rows))
    rc, err = in_process(main, [runs, "--n-boot", "0"], capsys)
    assert rc == 2 and "no row has a finite 'loss', the loss fitted" in one_error_line(err), err
    assert "it logs val_loss (--loss-key val_loss fits that loss, in every run); or leave the run out with " \
        "--skip-bad" in err, err
    log.unlink()
    rc, err = in_process(main, [runs, "--n-boot", "0"], capsys)
    assert rc == 2 and "not a run directory (missing metrics.jsonl, its loss log" in one_error_line(err), err
    rc = main([str(runs), "--n-boot", "0", "--skip-bad"])
    out = capsys.readouterr().out
    assert rc == 0 and f"left out: {runs / 'tnl-l1d96'}: not a run directory" in out and "2 run(s)" in out, out


def test_vocab_smaller_than_the_data(dataset, tmp_path, capsys):
    """--model vocab_size below the data's token ids is refused at start (not at the first forward), with
    the vocabulary that fits; for data tokenized here (the default corpus, a data YAML) the tokenizer's."""
    rc, _, err = pretrain(run_flags(tmp_path / "a", dataset, 2, "--model", "vocab_size=10"), capsys)
    assert rc == 2
    line = one_error_line(err)
    assert "--model vocab_size=10: the data in" in line and "use --model vocab_size=" in line
    rc, _, err = pretrain(["--model", "vocab_size=10", "--out", tmp_path / "b", "--max-steps", "1"], capsys)
    assert rc == 2
    assert "vocab_size=10 is smaller than the tokenizer's 100,277 ids" in one_error_line(err)
    assert pretrain(run_flags(tmp_path / "c", dataset, 1), capsys)[0] == 0  # 256 fits the synthetic data


def test_checkpoint_of_another_engine(dataset, tmp_path, capsys):
    """A plain PyTorch checkpoint resumed with --zero 2, and a DeepSpeed ZeRO-1 one with --zero 0: refused
    before the engine is built, saying exactly what to pass."""
    run = tmp_path / "plain"
    assert pretrain(run_flags(run, dataset, 2), capsys)[0] == 0
    rc, _, err = pretrain(run_flags(run, dataset, 4, "--zero", "2", "--resume", "auto"), capsys)
    assert rc == 2
    line = one_error_line(err)
    assert "was written by plain PyTorch/DDP (--zero 0) and this run is DeepSpeed ZeRO-2" in line
    assert "Resume it with --zero 0" in line
    pytest.importorskip("deepspeed")
    run = tmp_path / "zero"
    # one process without a launcher rendezvous on a port of its own: torch's default 29500 held by another
    # job on the node (here by this test, unless something else already holds it) does not stop it
    ds_env = {"DS_ACCELERATOR": "cpu", "MASTER_PORT": None}
    with socket.socket() as held:
        try:
            held.bind(("127.0.0.1", 29500))
            held.listen()
        except OSError:
            pass
        proc = cli("pretrain.py", *run_flags(run, dataset, 2, "--zero", "1"), extra_env=ds_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = cli("pretrain.py", *run_flags(run, dataset, 4, "--zero", "0", "--resume", "auto"), extra_env=ds_env)
    assert proc.returncode == 2
    line = one_error_line(proc.stderr)
    assert "was written by DeepSpeed ZeRO-1 (--zero 1) and this run is plain PyTorch/DDP" in line
    assert "Resume it with --zero 1" in line


def test_export_when_the_newest_checkpoint_is_corrupt(dataset, tmp_path, capsys):
    """export.py on a run without snapshots whose newest checkpoint is corrupt exports the newest intact
    one (with a warning); with every checkpoint corrupt it exits 2 listing them (never 0 with 0 exports)."""
    from launch.export import main
    run = tmp_path / "run"
    assert pretrain(run_flags(run, dataset, 4, "--save-every", "2", "--keep-last", "0"), capsys)[0] == 0
    _corrupt(run / "checkpoints" / "step_00000004")
    assert main([str(run)]) == 0
    out = capsys.readouterr().out
    assert "step_00000004 is incomplete or corrupt" in out and "trying the next older checkpoint" in out
    assert sorted(p.name for p in (run / "exports").iterdir()) == ["step_00000002"]
    _corrupt(run / "checkpoints" / "step_00000002")
    import shutil
    shutil.rmtree(run / "exports")
    assert main([str(run)]) == 2
    line = one_error_line(capsys.readouterr().err)
    assert "nothing exported" in line and "step_00000002" in line and "step_00000004" in line


def _evaluate_main(argv: list, capsys) -> tuple[int, str]:
    """launch/evaluate.py's main in this process (it replaces sys.path[0] on import: put it back)."""
    saved = list(sys.path)
    try:
        from launch.evaluate import main
    finally:
        sys.path[:] = saved
    return in_process(main, argv, capsys)


def test_evaluate_bad_input(dataset, tmp_path, capsys):
    """evaluate.py on a missing path, on a run without exports, with --tasks bogus, with numbers out of
    range, valid_loss without token files, and text tasks on a model whose vocabulary is smaller than the
    tokenizer's: one line or the usage error (listing the valid tasks), exit 2, before any model is run.
    export.py given one checkpoint instead of its run: the command to type."""
    run = tmp_path / "tiny"
    assert pretrain(run_flags(run, dataset, 1), capsys)[0] == 0
    from launch.export import main as export_main
    rc, err = in_process(export_main, [run / "checkpoints" / "step_00000001"], capsys)
    assert rc == 2 and f"not a run directory: pass its run and the step, launch/export.py {run} --step 1" \
        in one_error_line(err), err
    assert export_main([str(run)]) == 0
    capsys.readouterr()
    for args, expect in ((["--batch-size", "0"], "argument --batch-size: 0: out of range; allowed: >= 1"),
                         (["--limit", "-2"], "argument --limit: -2: out of range; allowed: >= 1"),
                         (["--niah-depths", "50", "150"], "argument --niah-depths: 150: out of range; allowed: >= 0 and <= 100"),
                         (["--niah-threshold", "11"], "argument --niah-threshold: 11: out of range"),
                         (["--tasks", "valid_loss"], "task valid_loss needs held-out data: pass --valid-shards"),
                         (["--tasks", "valid_loss", "--valid-shards", tmp_path / "none*.bin"], "nothing matches"),
                         (["--tasks", "wikitext2"], "the model's vocab_size 256 is smaller than the tokenizer's")):
        rc, err = _evaluate_main([run, "--device", "cpu", "--out", tmp_path / "eval", *args], capsys)
        assert rc == 2 and expect in err and "Traceback" not in err, (args, err)
    (tmp_path / "run").mkdir()
    missing, empty, proc = clis(("evaluate.py", tmp_path / "missing"), ("evaluate.py", tmp_path / "run"),
                                ("evaluate.py", tmp_path / "run", "--tasks", "bogus"))
    assert missing.returncode == 2 and "no such run or export directory" in one_error_line(missing.stderr)
    assert empty.returncode == 2 and "run launch/export.py first" in one_error_line(empty.stderr)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "argument --tasks: invalid choice: 'bogus' (choose from" in proc.stderr and "'wikitext2'" in proc.stderr


def _tiny_export(path: Path) -> Path:
    from models import build_model, save_pretrained
    return save_pretrained(build_model("tnl", "tiny", max_seq_len=64), path,
                           extra={"step": 1, "tokens": 64, "flops": 1e9, "train_seq_len": 32})


def test_output_folder_blocked_by_a_file(tmp_path, capsys, monkeypatch):
    """An output folder that cannot be made because a file is in the way (or --json naming a directory): one
    error line naming the flag and the file, before any model is loaded or any fit runs; mkdir's
    FileExistsError traceback before (fit_scaling's only after all the fits)."""
    export = _tiny_export(tmp_path / "exp")
    (tmp_path / "F").write_text("a file")
    from evaluation import sweep as sw
    monkeypatch.setattr(sw, "load_model", lambda *a: pytest.fail("a model was loaded"))
    for out in (tmp_path / "F", tmp_path / "F" / "eval"):
        rc, err = _evaluate_main([export, "--tasks", "wikitext2", "--device", "cpu", "--out", out], capsys)
        assert rc == 2 and f"--out {out}: cannot create the folder {out} ({tmp_path / 'F'} is a file, not a " \
            f"directory)" in one_error_line(err), err
    from scaling.synthetic import LossLaw, write_run
    from models.sizes import model_config
    for size in ("l1d32", "l1d64"):
        write_run(tmp_path / "runs" / f"tnl-{size}", model_config("tnl", size), LossLaw(), 1e8, n_rows=20)
    monkeypatch.setattr("launch.fit_scaling.analyze_arch", lambda *a: pytest.fail("a fit ran"))
    from launch.fit_scaling import main as fit_main
    (tmp_path / "D").mkdir()
    for args, expect in ((["--json", tmp_path / "F" / "fits.json"], f"--json {tmp_path / 'F' / 'fits.json'}: cannot create the folder"),
                         (["--markdown", tmp_path / "F" / "t.md"], "is a file, not a directory"),
                         (["--plots", tmp_path / "F"], f"--plots {tmp_path / 'F'}: cannot create the folder"),
                         (["--json", tmp_path / "D"], f"--json {tmp_path / 'D'}: is a directory; give a file path")):
        rc, err = in_process(fit_main, [tmp_path / "runs", "--n-boot", "0", *args], capsys)
        assert rc == 2 and expect in one_error_line(err), (args, err)


def test_evaluation_data_damaged(tmp_path, capsys, monkeypatch):
    """Evaluation files cut short, empty or of another kind, and held-out token files of the wrong size: one line
    naming the file (and line) and the fix; before, a ZeroDivisionError traceback (empty wiki.test.raw), a JSON
    message naming no file, or mmap's 'cannot mmap an empty file' that sank every other shard."""
    export = _tiny_export(tmp_path / "exp")
    data = tmp_path / "shared" / "eval"
    (data / "wikitext-2-raw").mkdir(parents=True)
    (data / "wikitext-2-raw" / "wiki.test.raw").write_text("")
    (data / "lambada").mkdir()
    lam = data / "lambada" / "lambada_test.jsonl"
    lam.write_text('{"text": "a b c"}\n{"text": "d e')
    monkeypatch.setenv("LINSCALE_SHARED_DATA", str(tmp_path / "shared"))
    base = [export, "--device", "cpu", "--out", tmp_path / "eval"]
    rc, err = _evaluate_main([*base, "--tasks", "wikitext2"], capsys)
    assert rc == 2 and f"{data / 'wikitext-2-raw' / 'wiki.test.raw'}: no text (an empty file)" in one_error_line(err)
    rc, err = _evaluate_main([*base, "--tasks", "lambada_openai"], capsys)
    assert rc == 2 and f"{lam}, line 2: not valid JSON" in one_error_line(err) and "cut short" in err
    lam.write_text('{"text": "a b c"}\n{"txt": "d e f"}\n')
    rc, err = _evaluate_main([*base, "--tasks", "lambada_openai"], capsys)
    assert rc == 2 and f"{lam}, line 2: a record without 'text'" in one_error_line(err)
    (data / "piqa").mkdir()
    (data / "piqa" / "valid.jsonl").write_text('{"goal": "g", "sol1": "a", "sol2": "b"}\n' * 3)
    (data / "piqa" / "valid-labels.lst").write_text("0\n1\n")
    from evaluation.local_data import load_piqa
    with pytest.raises(ValueError, match=r"valid-labels.lst: 2 labels for the 3 records of .*valid.jsonl"):
        load_piqa()
    import numpy as np
    np.arange(3 * 33, dtype=np.uint32).tofile(tmp_path / "v0.bin")
    (tmp_path / "v1.bin").write_bytes(b"")
    rc, err = _evaluate_main([*base, "--tasks", "valid_loss", "--valid-shards", tmp_path / "v*.bin",
                              "--valid-seq-len", "32"], capsys)
    assert rc == 0, err   # the empty shard holds no window; the other is read
    rows = json.loads((tmp_path / "eval" / "results.json").read_text())["snapshots"]
    assert rows[0]["results"]["valid_loss"]["windows"] == 3
    (tmp_path / "v2.bin").write_bytes(b"\0" * 6)
    rc, err = _evaluate_main([*base, "--tasks", "valid_loss", "--valid-shards", tmp_path / "v*.bin",
                              "--valid-seq-len", "32", "--force"], capsys)
    assert rc == 2 and f"{tmp_path / 'v2.bin'}: 6 bytes, not a whole number of uint32 tokens" in one_error_line(err)
    rc, err = _evaluate_main([*base, "--tasks", "valid_loss", "--valid-shards", tmp_path / "v1.bin"], capsys)
    assert rc == 2 and "hold no window of --valid-seq-len 2048 + 1 tokens" in one_error_line(err)


def _piqa_data(root: Path, items: list[tuple[str, str, str, int]]) -> None:
    (root / "eval" / "piqa").mkdir(parents=True)
    (root / "eval" / "piqa" / "valid.jsonl").write_text(
        "".join(json.dumps({"goal": g, "sol1": a, "sol2": b}) + "\n" for g, a, b, _ in items))
    (root / "eval" / "piqa" / "valid-labels.lst").write_text("".join(f"{y}\n" for *_, y in items))


def test_evaluate_window_shorter_than_a_continuation(tmp_path, capsys, monkeypatch):
    """A commonsense item whose continuation is longer than the scoring window (the export's training context,
    32 tokens here): one line naming the task, the item and the --max-length that fits; with that window the
    task runs, and the items whose context was cut from the left are counted in the table (by hand: 2, the long
    solution's own item and the long question's)."""
    from evaluation.perplexity import encode_pair
    export = _tiny_export(tmp_path / "exp")
    long_sol = "wrap the handle " + "with several layers of strong tape " * 6
    items = [("Keep a pan handle cool", "Wrap it in foil", "Leave it in the oven", 0),
             ("Open a jar", long_sol, "Hit it hard", 1),
             ("Question about a very long topic " * 8, "Yes", "No", 0)]
    _piqa_data(tmp_path / "shared", items)
    monkeypatch.setenv("LINSCALE_SHARED_DATA", str(tmp_path / "shared"))
    need = len(encode_pair("Question: Open a jar\nAnswer:", " " + long_sol)[1])
    assert need > 32
    base = [export, "--tasks", "piqa", "--device", "cpu", "--out", tmp_path / "eval"]
    rc, err = _evaluate_main(base, capsys)
    line = one_error_line(err)
    assert rc == 2 and f"task piqa: task piqa_local, item 1: a continuation of {need} tokens is longer than the " \
        f"scoring window max_length 32" in line and f"Pass --max-length {need} or more" in line, err
    cut = sum(any(len(sum(encode_pair(f"Question: {g}\nAnswer:", " " + c), [])) > need + 1 for c in (a, b))
              for g, a, b, _ in items)
    assert cut == 2
    rc, err = _evaluate_main([*base, "--max-length", need], capsys)
    assert rc == 0, err
    assert f"piqa_local: the context of 2 of 3 items is cut from the left to fit the scoring window of {need}" in err
    row = json.loads((tmp_path / "eval" / "results.json").read_text())["snapshots"][0]
    assert row["results"]["piqa"]["truncated"] == 2 and 0 <= row["results"]["piqa"]["acc"] <= 1


def test_evaluate_an_export_with_a_damaged_config(tmp_path, capsys, monkeypatch):
    """A run with one export's config.json cut short: a warning names the file and the command that exports it
    again, its row carries the error, the other export is evaluated (the sweep refused to start before)."""
    from models import build_model, save_pretrained
    import numpy as np
    run = tmp_path / "run"
    for step in (1, 2):
        save_pretrained(build_model("tnl", "tiny", max_seq_len=64), run / "exports" / f"step_{step:08d}",
                        extra={"step": step, "tokens": 64 * step, "flops": 1e9 * step, "train_seq_len": 32})
    cfg = run / "exports" / "step_00000001" / "config.json"
    cfg.write_text(cfg.read_text()[:30])
    np.arange(3 * 33, dtype=np.uint32).tofile(tmp_path / "v.bin")
    rc, err = _evaluate_main([run, "--tasks", "valid_loss", "--valid-shards", tmp_path / "v.bin", "--valid-seq-len",
                              "32", "--device", "cpu", "--out", tmp_path / "eval"], capsys)
    assert rc == 0 and "Traceback" not in err, err
    assert f"{cfg}: not valid JSON" in err and f"launch/export.py {run} --step 1 --force" in err, err
    import csv
    with open(tmp_path / "eval" / "results.csv") as fh:
        table = list(csv.DictReader(fh))
    assert [r["snapshot"] for r in table] == ["step_00000001", "step_00000002"]
    assert "config.json: not valid JSON" in table[0]["errors"] and table[0]["valid_loss/loss"] == ""
    assert table[1]["errors"] == "" and float(table[1]["valid_loss/windows"]) == 3
    # an export removed after the sweep found it (a re-export replacing it): its row says so, the others go on
    from evaluation import sweep as sw
    import shutil
    found = sw.find_snapshots
    cfg.write_text(json.dumps({"model": build_model("tnl", "tiny").config.to_dict(), "step": 1}))
    gone = run / "exports" / "step_00000001"

    def find_then_remove(*a, **k):
        snaps = found(*a, **k)
        shutil.rmtree(gone)
        return snaps
    monkeypatch.setattr(sw, "find_snapshots", find_then_remove)
    rc, err = _evaluate_main([run, "--tasks", "valid_loss", "--valid-shards", tmp_path / "v.bin", "--valid-seq-len",
                              "32", "--device", "cpu", "--out", tmp_path / "eval2"], capsys)
    assert rc == 0 and f"cannot read {gone}: No such file or directory (removed or replaced since the sweep " \
        f"started)" in err, err
    with open(tmp_path / "eval2" / "results.csv") as fh:
        table = list(csv.DictReader(fh))
    assert "cannot read" in table[0]["errors"] and float(table[1]["valid_loss/windows"]) == 3


def test_niah_grid_that_cannot_run(tmp_path, capsys, monkeypatch):
    """NIAH lengths too short for the needle and the question, and an empty grid: one line naming the fix,
    before any model is loaded (the short length failed only after the model was loaded)."""
    from evaluation import sweep as sw
    from evaluation.niah import NiahConfig, check_lengths, run_niah
    export = _tiny_export(tmp_path / "exp")
    (tmp_path / "hay.txt").write_text("grass " * 200)
    monkeypatch.setattr(sw, "load_model", lambda *a: pytest.fail("a model was loaded"))
    rc, err = _evaluate_main([export, "--tasks", "niah_easy", "--niah-lengths", "16", "64", "--niah-depths", "0", "50",
                              "--niah-haystack", tmp_path / "hay.txt", "--device", "cpu", "--out", tmp_path / "e"],
                             capsys)
    line = one_error_line(err)
    assert rc == 2 and "NIAH easy: context length 16 too short for the needle and the question" in line, err
    least = int(re.search(r"give --niah-lengths of at least (\d+)", line).group(1))
    assert 16 < least <= 64
    check_lengths(NiahConfig(mode="easy", lengths=(least, 64), depths=(0.0, 50.0)))
    with pytest.raises(ValueError, match=r"NIAH depths: the grid is empty.*--niah-depths 0 50 100"):
        run_niah(None, NiahConfig(depths=()))
    with pytest.raises(ValueError, match=r"NIAH lengths: the grid is empty.*--niah-lengths"):
        sw.sweep(sw.SweepConfig(runs=[str(export)], tasks=["niah_standard"], niah_lengths=[], device="cpu",
                                niah_haystack=[str(tmp_path / "hay.txt")], out=str(tmp_path / "e")))


def test_every_command_has_the_handler(tmp_path):
    """Every command in launch/ (benchmarks and the study driver too) runs under the one user-error
    handler, so a bad flag or file ends in one `error:` line and exit 2, never a traceback; numeric
    benchmark flags are range-checked (a step count of 0 or less used to hang or end in a
    StatisticsError)."""
    for script in sorted((ROOT / "launch").glob("*.py")):
        text = script.read_text()
        assert "run_cli(" in text or "from pretrain.trainer import main" in text, \
            f"{script.name} does not run its main under pretrain.errors.run_cli"
    procs = clis(("bench_checkpoint.py", "--steps", "-1"),
                 ("bench_data.py", "--config", tmp_path / "missing.yaml"),
                 ("bench_scaling_calibration.py", "--repeats", "0"),
                 ("study.py", "plan", "--config", tmp_path / "missing.yaml"),
                 ("bench_train.py", "--archs", "tnl,tnll"),
                 ("bench_train.py", "--sizes", "1b,13b"),
                 ("bench_train.py", "--seqs", "8k"),
                 ("bench_kernels.py", "--matrix", "--shapes", "2x0"),
                 ("bench_kernels.py", "--matrix", "--T", "0"),
                 ("bench_multi_gpu.py", "--counts", "0,2"),
                 ("bench_multi_gpu.py", "--rehearse", "--warm", "5", "--steps", "5"),
                 ("bench_multi_gpu.py", "--rehearse", "--archs", "tnl,tnll", "--print-plan"))
    expect = ["argument --steps: -1: out of range; allowed: >= 1",
              f"error: data config {tmp_path / 'missing.yaml'} not found",
              "argument --repeats: 0: out of range; allowed: >= 1",
              f"error: study config: {tmp_path / 'missing.yaml'}: no such file",
              "argument --archs: unknown arch 'tnll'; choose from llama, tnl, hgrn2, cos2",
              "argument --sizes: unknown size '13b'; choose from tiny, mini, 70m",
              "argument --seqs: '8k': give whole numbers from 1, comma-separated",
              "argument --shapes: '2x0': give batch x heads as BxH with both >= 1",
              "argument --T: 0: out of range; allowed: >= 1",
              "argument --counts: '0,2': give whole numbers from 1, comma-separated",
              "--warm 5 leaves none of the 5 steps to time",
              "argument --archs: unknown arch 'tnll'"]
    for proc, want in zip(procs, expect):
        assert proc.returncode == 2 and want in one_error_line(proc.stderr), (proc.args, proc.stderr[-2000:])


def test_model_info_bad_sizes(capsys):
    """model_info with a zero or negative --seq-len / --batch (ZeroDivisionError / nonsense before), or an
    unknown --size: usage error or one line, exit 2."""
    from launch.model_info import main
    for args, expect in ((["--seq-len", "0"], "argument --seq-len: 0: out of range; allowed: >= 1"),
                         (["--batch", "-3"], "argument --batch: -3: out of range; allowed: >= 1"),
                         (["--size", "-5"], "error: unknown size '-5'; choose from tiny, mini, 70m")):
        rc, err = in_process(main, ["--arch", "tnl", "--size", "70m", *args], capsys)
        assert rc == 2 and expect in err and "Traceback" not in err, err
    proc = cli("model_info.py", "--arch", "tnl", "--size", "70m", "--seq-len", "0")  # as the terminal shows it
    assert proc.returncode == 2 and "--seq-len: 0: out of range" in proc.stderr and "Traceback" not in proc.stderr
    # --model overrides as launch/pretrain.py takes them: the counts of the overridden shape, or one line
    # naming the flags and the problem
    assert main(["--arch", "tnl", "--size", "70m", "--model", "n_layers=12", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["model"]["n_layers"] == 12 and info["params_non_embedding"] == 12 * (4 * 512**2 + 2 * 512 * 128
                                                                                     + 3 * 512 * 1536)
    for args, expect in ((["--model", "n_layers=0"], "error: --arch tnl --size 70m --model n_layers=0: model config: "
                                                     "n_layers must be a positive integer, got 0"),
                         (["--model", "n_heads=3"], "error: --arch tnl --size 70m --model n_heads=3: model config: "
                                                    "head count n_heads=3 does not divide the width d_model=512"),
                         (["--model", "d_model=abc"], "error: --model d_model=abc: d_model expects an integer"),
                         (["--model", "dmodel=3"], "error: --model dmodel=3: unknown model field 'dmodel'"),
                         (["--model", "d_glu"], "error: --model 'd_glu': expected FIELD=VALUE")):
        rc, err = in_process(main, ["--arch", "tnl", "--size", "70m", *args], capsys)
        assert rc == 2 and one_error_line(err).startswith(expect), err
    rc, err = in_process(main, ["--arch", "llama", "--size", "tiny", "--model", "d_model=130"], capsys)
    assert rc == 2 and "head width e = d/h must be even" in one_error_line(err)


def test_list_flags_of_the_benchmarks():
    """The list types of the benchmarks' flags (pretrain.argtypes): registry names resolved (aliases, case),
    whole numbers within their bounds; anything else a usage error naming the value and the choices."""
    import argparse

    from models.registry import canonical_arch
    from models.sizes import canonical_size
    from pretrain.argtypes import int_list, name_list
    assert name_list(canonical_arch)("CosFormer2,tnl, llama") == ["cos2", "tnl", "llama"]
    assert name_list(canonical_size)("1B,l2d128") == ["1b", "l2d128"]
    assert int_list(0, 3)("1,0, 3") == [1, 0, 3]
    for parse, text, want in ((name_list(canonical_arch), "tnl,gpt", "unknown arch 'gpt'; choose from llama, tnl"),
                              (name_list(canonical_size), ",", "empty"),
                              (int_list(1), "2,0", "'2,0': give whole numbers from 1,"),
                              (int_list(0, 3), "4", "from 0 to 3"),
                              (int_list(1), "2k", "'2k': give whole numbers")):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(want)):
            parse(text)
