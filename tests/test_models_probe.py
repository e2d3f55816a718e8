"""The model config's number fields, `LanguageModel.generate`'s prefill, and `launch/model_info.py`'s output
against hand counts and against the run `launch/pretrain.py` would configure."""
import json
import math
import re

import numpy as np
import pytest
import torch

from models import build_model, load_pretrained, model_config, save_pretrained

ARCHS = ["llama", "tnl", "hgrn2", "cos2"]
FLOAT_FIELDS = ["rope_base", "norm_eps", "init_std", "tpe_init_bound"]


# -- config: the float fields -------------------------------------------------------------------------

@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", ["1e-6", True, None, [0.5]])
def test_float_config_fields_refuse_what_is_not_a_real_number(field, value):
    """float() takes the string '1e-6' and True: the string failed only at the first forward (a TypeError
    inside torch: RoPE's base ** tensor, eps + tensor, normal_(std='0.02')) and True built a model with an
    epsilon or init std of 1. Refused by name, as the integer fields are."""
    want = rf"model config: {field} must be a finite number .*got {re.escape(repr(value))}"
    with pytest.raises(ValueError, match=want):
        model_config("cos2" if field == "tpe_init_bound" else "llama", "tiny", **{field: value})


def test_float_config_fields_are_stored_as_floats():
    cfg = model_config("llama", "tiny", rope_base=500000, norm_eps=np.float32(1e-5), init_std=np.float64(0.01),
                       tpe_init_bound=0)
    assert [type(getattr(cfg, f)) for f in FLOAT_FIELDS] == [float] * 4
    assert (cfg.rope_base, cfg.norm_eps, cfg.init_std, cfg.tpe_init_bound) == (500000.0, np.float32(1e-5), 0.01, 0.0)


def test_load_pretrained_refuses_a_config_json_with_a_number_as_a_string(tmp_path):
    """A hand-edited config.json ("norm_eps": "1e-6") is refused when loaded, naming the file and the field,
    not at the first forward."""
    torch.manual_seed(0)
    path = save_pretrained(build_model("tnl", "tiny", vocab_size=61), tmp_path / "export")
    meta = json.loads((path / "config.json").read_text())
    meta["model"]["norm_eps"] = "1e-6"
    (path / "config.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"config\.json: model config: norm_eps must be a finite number > 0, "
                                         r"got '1e-6'"):
        load_pretrained(path)


# -- generate: the prefill ----------------------------------------------------------------------------

@pytest.mark.parametrize("arch", ARCHS)
def test_generate_applies_the_head_to_one_position_per_row(arch):
    """The prompt's logits are [batch, length, vocab] fp32, 400 kB a token at the paper's vocabulary (3 GB for
    an 8K-token prompt): generate needs the last row of them only. Every head call sees one position per row,
    and the tokens are those of greedy decoding recomputed from scratch in float64 (the parallel forward over
    the whole growing sequence at every step)."""
    torch.manual_seed(0)
    model = build_model(arch, "tiny", vocab_size=61).double().eval()
    prompt = torch.randint(0, 61, (2, 37))
    seen = []
    head = model.logits

    def recording(h):
        seen.append(tuple(h.shape))
        return head(h)

    model.logits = recording
    out = model.generate(prompt, max_new_tokens=4)
    del model.logits
    assert seen == [(2, model.config.d_model)] * 4  # the prefill and three fed-back tokens, one row each
    seq = prompt
    with torch.no_grad():
        for _ in range(4):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


# -- launch/model_info.py -----------------------------------------------------------------------------

def _model_info(argv, capsys):
    from launch.model_info import main
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as exc:
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("arch", ARCHS)
def test_model_info_json_flops_are_floats_and_llama_equals_a_hand_count(arch, capsys):
    """The JSON gives FLOPs as floats for every architecture: LLaMA's all-integer formula gave ints (and the
    linear models floats), one type for one architecture and another for the next. LLaMA's count by hand, from
    its equations: 6 FLOPs per matmul parameter per token (forward + backward), QK^T and AV over the full
    n x n (2 n^2 d multiply-adds each, x3), the softmax's 3 n^2 h (x3), the GLU product 3 n g, and the tied
    head counted as input and output, 12 d v per token."""
    b, n = 3, 40
    rc, out, err = _model_info(["--arch", arch, "--size", "tiny", "--batch", b, "--seq-len", n, "--json",
                                "--model", "vocab_size=1000"], capsys)
    assert rc == 0, err
    info = json.loads(out)
    for key in ("flops_per_step", "flops_per_step_non_embedding", "flops_per_token"):
        assert type(info[key]) is float, (key, info[key])
    for key in ("params_non_embedding", "params_total", "params_non_embedding_paper"):
        assert type(info[key]) is int, (key, info[key])
    l, d, h, g, v = 2, 128, 2, 384, 1000
    assert info["flops_per_step"] - info["flops_per_step_non_embedding"] == 12 * b * n * d * v
    assert info["flops_per_token"] == info["flops_per_step"] / (b * n)
    if arch == "llama":
        matmul_params = l * (4 * d * d + 3 * d * g)
        per_layer = 3 * (2 * n * n * d + 2 * n * n * d) + 3 * (3 * n * n * h) + 3 * n * g
        assert info["flops_per_step"] == 6 * matmul_params * b * n + b * l * per_layer + 12 * b * n * d * v


@pytest.mark.parametrize("seq_len", [4096, 16384])
def test_model_info_sizes_llamas_rope_table_as_pretrain_does(seq_len, capsys):
    """The counts are "those of the model that run would train": for LLaMA that run's RoPE table fits
    --seq-len (launch/pretrain.py sizes it to max(seq_len, 8192)), so the JSON's model config is the one
    pretrain.py builds; the printed table said 8192 at --seq-len 16384, a model that cannot take the run's
    sequences."""
    from pretrain.config import parse_config
    rc, out, err = _model_info(["--arch", "llama", "--size", "70m", "--seq-len", seq_len, "--json"], capsys)
    assert rc == 0, err
    want = parse_config(["--arch", "llama", "--size", "70m", "--seq-len", str(seq_len)]).model().to_dict()
    assert json.loads(out)["model"] == want
    assert want["max_seq_len"] == max(seq_len, 8192)


def test_model_info_refuses_a_rope_table_shorter_than_the_sequence(capsys):
    """launch/pretrain.py refuses LLaMA with --model max_seq_len below --seq-len; model_info printed the
    FLOPs of that run as if it could train. The linear models have no table and take any length."""
    rc, out, err = _model_info(["--arch", "llama", "--size", "70m", "--seq-len", "16384", "--model",
                                "max_seq_len=8192"], capsys)
    assert rc == 2 and out == ""
    assert ("error: --arch llama --size 70m --model max_seq_len=8192: LLaMA's RoPE table (max_seq_len=8192) is "
            "shorter than --seq-len 16384; pass --model max_seq_len=16384 or larger") in err
    assert "Traceback" not in err
    rc, out, err = _model_info(["--arch", "tnl", "--size", "70m", "--seq-len", "16384", "--model",
                                "max_seq_len=8192"], capsys)
    assert rc == 0 and "batch 480 x seq 16384" in out, err


def test_model_info_help_lists_the_architectures_and_sizes(capsys):
    from models import SIZES, arch_names
    rc, out, _ = _model_info(["--help"], capsys)
    flat = " ".join(out.split())  # argparse wraps the help text
    assert rc == 0
    assert ", ".join(arch_names()) in flat and "transnormer" in flat and "cosformer2" in flat
    assert ", ".join(SIZES) in flat


def test_model_info_text_is_the_json_rounded(capsys):
    """The text output's numbers are the JSON's, in the units they name (M parameters, PFLOPs per step)."""
    argv = ["--arch", "cos2", "--size", "1b"]
    _, text, _ = _model_info(argv, capsys)
    _, js, _ = _model_info(argv + ["--json"], capsys)
    info = json.loads(js)
    assert f"non-embedding parameters: {info['params_non_embedding'] / 1e6:,.1f}M" in text
    assert f"training FLOPs per step:  {info['flops_per_step'] / 1e15:,.2f} PFLOPs" in text
    assert math.isclose(info["flops_per_step"] / 1e15, 29.99, abs_tol=0.005)  # docs/architectures.md's table
