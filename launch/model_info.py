"""Parameters and training FLOPs of a model by the paper's formulas:
`python launch/model_info.py --arch tnl --size 7b [--batch 480] [--seq-len 8192] [--model FIELD=VALUE] [--json]`.
`--model` overrides a ModelConfig field as launch/pretrain.py's flag does (e.g. a custom shape,
`--model n_layers=8 --model d_model=1024`), so the counts are those of the model that run would train."""
import argparse
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import SIZES, get_arch, model_config, model_info  # noqa: E402
from models.registry import ACCEPTED_ARCH_NAMES  # noqa: E402
from pretrain.argtypes import positive_int  # noqa: E402
from pretrain.config import MIN_ROPE_TABLE, describe_model_flags, model_overrides_from_flags  # noqa: E402
from pretrain.errors import ConfigError, run_cli  # noqa: E402


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--arch", required=True, help=f"architecture, any case: {', '.join(ACCEPTED_ARCH_NAMES)}")
    p.add_argument("--size", required=True, help=f"registry size, any case: {', '.join(SIZES)}")
    p.add_argument("--batch", type=positive_int, default=480, help="sequences per step (>= 1)")
    p.add_argument("--seq-len", type=positive_int, default=8192, help="tokens per sequence (>= 1)")
    p.add_argument("--model", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a ModelConfig field as launch/pretrain.py does, e.g. --model d_model=1024 "
                        "(repeatable)")
    p.add_argument("--json", action="store_true",
                   help="print every count as JSON (parameters as integers, FLOPs as floats) and the model config")
    a = p.parse_args(argv)
    overrides = model_overrides_from_flags(a.model)
    flags = describe_model_flags(a.arch, a.size, overrides)
    sized = dict(overrides)
    if get_arch(a.arch).context_limited:
        # the RoPE table as launch/pretrain.py sizes it for --seq-len (RunConfig.model), so that the config
        # printed is the one that run would train
        sized.setdefault("max_seq_len", max(a.seq_len, MIN_ROPE_TABLE))
    try:
        cfg = model_config(a.arch, a.size, **sized)
    except ValueError as err:
        if not overrides:
            raise
        # name the overrides too: the shape error may come from their combination with the size's shape
        raise ConfigError(f"{flags}: {err}") from None
    if cfg.max_seq_len < a.seq_len and get_arch(cfg.arch).context_limited:
        # launch/pretrain.py refuses this run: positions past the RoPE table have no encoding
        raise ConfigError(f"{flags}: {get_arch(cfg.arch).title}'s RoPE table (max_seq_len={cfg.max_seq_len}) is "
                          f"shorter than --seq-len {a.seq_len}; pass --model max_seq_len={a.seq_len} or larger, "
                          f"or leave it out (the default fits --seq-len)")
    info = model_info(cfg, a.batch, a.seq_len)
    if a.json:
        print(json.dumps({**dataclasses.asdict(info), "model": cfg.to_dict()}, indent=2))
        return 0
    print(f"{info.arch} {info.size}: l={cfg.n_layers}, d={cfg.d_model}, h={cfg.n_heads} (e={cfg.head_dim}), "
          f"g={cfg.d_glu} (batch {info.batch} x seq {info.seq_len})")
    print(f"  non-embedding parameters: {info.params_non_embedding / 1e6:,.1f}M "
          f"(paper formula {info.params_non_embedding_paper / 1e6:,.1f}M)")
    print(f"  total parameters:         {info.params_total / 1e6:,.1f}M")
    print(f"  training FLOPs per step:  {info.flops_per_step / 1e15:,.2f} PFLOPs "
          f"({info.flops_per_step_non_embedding / 1e15:,.2f} without the embedding term)")
    print(f"  training FLOPs per token: {info.flops_per_token:,.4g}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Errors in the input end in one `error:` line and exit code 2 (docs/errors.md)."""
    return run_cli(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
