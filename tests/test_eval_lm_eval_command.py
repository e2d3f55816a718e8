"""`lm_eval --model linscale ...` works as a plain command after either install: `pip install .` and
`pip install -e .` both put linscale_lm_eval.pth into site-packages, where `site` reads it at start-up and
imports the adapter when the command is `lm_eval` (lm-eval has no plugin discovery). On a machine without
CUDA the command works without device=cpu (lm-eval passes --device cuda:0 unless told otherwise)."""
import base64
import hashlib
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from eval_utils import write_tiny_mc_task
from models import build_model, save_pretrained

ROOT = Path(__file__).resolve().parents[1]
HOOK = "linscale_lm_eval.pth"
PACKAGES = ["pretrain", "models", "ops", "data_pipeline", "checkpoints", "evaluation", "scaling"]


def _hook_installed() -> bool:
    dirs = site.getsitepackages() + [site.getusersitepackages()]
    return any((Path(d) / HOOK).exists() for d in dirs)


def _source_copy(dst: Path) -> Path:
    """What setup.py packages (no tests, no data): builds never write into the checkout."""
    dst.mkdir()
    for f in ("setup.py", HOOK, "README.md"):
        shutil.copy(ROOT / f, dst / f)
    for p in PACKAGES:
        shutil.copytree(ROOT / p, dst / p, ignore=shutil.ignore_patterns("__pycache__"))
    return dst


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _needs_setuptools():
    pytest.importorskip("setuptools", reason="building linscale's wheels needs setuptools in this environment")


@pytest.mark.parametrize("kind", ["wheel", "editable"])
def test_both_wheels_install_the_hook_into_site_packages(tmp_path, kind):
    """A wheel's root is what pip unpacks into site-packages: the hook must sit there, listed in RECORD with
    its hash, in the wheel of `pip install .` and in the editable wheel of `pip install -e .` (PEP 660)."""
    _needs_setuptools()
    src = _source_copy(tmp_path / "src")
    out = tmp_path / "dist"
    out.mkdir()
    build = "build_wheel" if kind == "wheel" else "build_editable"
    res = subprocess.run([sys.executable, "-c", f"import setuptools.build_meta as b; print(b.{build}({str(out)!r}))"],
                         cwd=src, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (whl,) = out.glob("*.whl")
    with zipfile.ZipFile(whl) as z:
        names = z.namelist()
        assert HOOK in names, f"{HOOK} is not at the root of the {kind} wheel: {names[:20]}"
        data = z.read(HOOK)
        (record,) = [n for n in names if n.endswith(".dist-info/RECORD")]
        rows = {line.split(",")[0]: line.split(",")[1] for line in z.read(record).decode().splitlines() if line}
    assert data == (ROOT / HOOK).read_bytes()
    assert rows[HOOK] == _record_hash(data)
    if kind == "editable":
        assert any(n.startswith("__editable__") for n in names)   # modules resolve to the source tree
    else:  # `pip install .` must carry every module and task file of the checkout, subpackages included
        wanted = {f.relative_to(src).as_posix() for p in PACKAGES for f in (src / p).rglob("*")
                  if f.suffix in (".py", ".yaml") and "__pycache__" not in f.parts}
        assert "scaling/study/__init__.py" in wanted
        missing = sorted(wanted - set(names))
        assert not missing, f"the wheel lacks {len(missing)} file(s) of the checkout: {missing[:10]}"


def test_editable_install_registers_the_model_when_lm_eval_starts(tmp_path):
    """`pip install -e .` into a fresh virtual environment (its other packages borrowed from this one), then
    lm-eval's own command (the console script pip writes: `cli_evaluate()` in a program named lm_eval) started by
    that environment's Python evaluates `--model linscale` from the editable source, with no device given
    (lm-eval's cuda:0: the GPU where there is one, the CPU fallback on a machine without CUDA)."""
    _needs_setuptools()
    src = _source_copy(tmp_path / "src")
    venv = tmp_path / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"cannot create a virtual environment here: {made.stderr[-300:]}")
    py = venv / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True).stdout.strip()
    here = [p for p in site.getsitepackages() if (Path(p) / "lm_eval").is_dir()]
    if not here:
        pytest.skip("lm-eval is not installed in a site-packages directory of this Python")
    # sorts before the hook, so lm_eval and torch are importable when the hook runs (as in a full install)
    # borrowed without linscale itself: where this Python has it installed (not editable, as in CI), a borrowed
    # copy would shadow the editable source under test
    borrowed = tmp_path / "borrowed"
    borrowed.mkdir()
    for entry in Path(here[0]).iterdir():
        if entry.name in PACKAGES or entry.name == HOOK or entry.name.lower().startswith(("linscale", "__editable__")):
            continue
        (borrowed / entry.name).symlink_to(entry)
    (Path(purelib) / "aa_borrow_packages.pth").write_text(f"{borrowed}\n")
    pip = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps",
                          "--no-build-isolation", "-e", str(src)], capture_output=True, text=True, timeout=300)
    if pip.returncode != 0 and "no such option: --python" in pip.stderr:
        pytest.skip("this pip cannot install into another environment (--python needs pip >= 22.3)")
    assert pip.returncode == 0, pip.stderr[-3000:]
    assert (Path(purelib) / HOOK).is_file()
    prog = venv / "bin" / "lm_eval"
    # nothing imported by the program before lm-eval's CLI: only the hook, run by `site` at start-up, can have
    # registered the model; then the source it came from is printed
    prog.write_text(f"#!{py}\nimport sys\nhooked = 'evaluation.lm_eval_adapter' in sys.modules\n"
                    "from lm_eval.__main__ import cli_evaluate\ncli_evaluate()\n"
                    "import evaluation\nprint('SOURCE', evaluation.__file__, hooked)\n")
    prog.chmod(0o755)
    rows = [{"q": "The sky is", "choices": [" blue", " green"], "label": 0},
            {"q": "Fire is", "choices": [" hot", " cold"], "label": 0}]
    write_tiny_mc_task(tmp_path, "tiny_editable", rows)
    torch.manual_seed(0)
    save_pretrained(build_model("hgrn2", "tiny", max_seq_len=64), tmp_path / "export")
    args = ["--model", "linscale", "--model_args", f"pretrained={tmp_path / 'export'}", "--tasks", "tiny_editable",
            "--include_path", str(tmp_path), "--output_path", str(tmp_path / "res")]
    res = subprocess.run([str(prog), *args], capture_output=True, text=True, timeout=600,
                         env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert res.returncode == 0, res.stderr[-3000:]
    where, hooked = res.stdout.rsplit("SOURCE", 1)[1].split()[:2]
    assert hooked == "True" and Path(where).is_relative_to(src)         # the editable source, not a copy
    (result,) = (tmp_path / "res").rglob("results*.json")
    assert 0.0 <= json.loads(result.read_text())["results"]["tiny_editable"]["acc,none"] <= 1.0


def test_hook_imports_the_adapter_only_for_the_lm_eval_command(tmp_path):
    """The .pth line, read by `site` exactly as at interpreter start-up: the model is registered when the
    program is `lm_eval`, and nothing is imported for any other program."""
    shutil.copy(ROOT / HOOK, tmp_path / HOOK)
    probe = ("import site, sys; sys.argv = [{argv0!r}]; site.addsitedir({d!r}); "
             "print('evaluation.lm_eval_adapter' in sys.modules, end=' '); "
             "import lm_eval.api.registry as r; print('linscale' in r.model_registry.keys())")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for argv0, expect in (("/venv/bin/lm_eval", "True True"), ("/venv/bin/lm-eval", "True True"),
                          ("/venv/bin/python", "False False"), ("lm_eval_wrapper.py", "False False")):
        res = subprocess.run([sys.executable, "-c", probe.format(argv0=argv0, d=str(tmp_path))], env=env,
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        assert res.stdout.split()[-2:] == expect.split(), (argv0, res.stdout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the fallback of a machine without CUDA")
def test_cli_default_device_falls_back_to_the_cpu(tmp_path):
    """lm-eval's CLI calls create_from_arg_string(model_args, {"device": "cuda:0", "batch_size": 1, ...})."""
    from evaluation.lm_eval_adapter import LinscaleLM, resolve_device
    assert resolve_device("cuda:0") == "cpu" and resolve_device("cuda") == "cpu" and resolve_device("cpu") == "cpu"
    save_pretrained(build_model("hgrn2", "tiny", max_seq_len=64), tmp_path / "export")
    lm = LinscaleLM.create_from_arg_string(f"pretrained={tmp_path / 'export'}",
                                           {"batch_size": 1, "max_batch_size": None, "device": "cuda:0"})
    assert lm.device.type == "cpu" and lm.batch_size_per_gpu == 1


@pytest.mark.skipif(not _hook_installed(), reason="linscale is not installed here (pip install -c constraints.txt .)")
def test_plain_lm_eval_command_runs_the_linscale_model(tmp_path):
    """The installed command, with no device in model_args: on a CPU-only machine this is lm-eval's cuda:0."""
    exe = shutil.which("lm_eval", path=str(Path(sys.executable).parent)) or shutil.which("lm_eval")
    assert exe, "lm_eval command not found next to this Python"
    rows = [{"q": "The sky is", "choices": [" blue", " green"], "label": 0},
            {"q": "Fire is", "choices": [" hot", " cold"], "label": 0}]
    write_tiny_mc_task(tmp_path, "tiny_cmd", rows)
    torch.manual_seed(0)
    save_pretrained(build_model("tnl", "tiny", max_seq_len=64), tmp_path / "export")
    out = subprocess.run([exe, "--model", "linscale", "--model_args", f"pretrained={tmp_path / 'export'}",
                          "--tasks", "tiny_cmd", "--include_path", str(tmp_path), "--output_path", str(tmp_path / "res")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    results = list((tmp_path / "res").rglob("results*.json"))
    assert results, out.stdout[-2000:]
    acc = json.loads(results[0].read_text())["results"]["tiny_cmd"]["acc,none"]
    assert 0.0 <= acc <= 1.0
