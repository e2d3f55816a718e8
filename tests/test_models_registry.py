"""The architecture registry: a fifth architecture is one spec (models.spec.ArchSpec) and one registration,
and then builds, counts its parameters and FLOPs, trains through the normal trainer, and loads back; the
mixers take no catch-all keywords; the registry's own errors."""
import json

import pytest
import torch
from torch import nn

from checkpoint_utils import make_dataset, run_flags, train_in_process
from models import build_model, exact_params, flops_per_step, load_pretrained, model_config, save_pretrained
from models.config import ModelConfig
from models.layers import Norm, sglu
from models.registry import arch_names, canonical_arch, get_arch, register_arch, unregister_arch
from models.spec import ArchSpec, ModelExtra


# -- a toy architecture, written as a model file would be -------------------------------------------
class EmaMixer(nn.Module):
    """o_t = W_o Norm(scale * sum_{s<=t} (1-a) a^(t-s) W_i x_s), a fixed per layer; `scale` (a learned
    per-layer gain) comes from the model-level extra, so the test sees extras reach the mixers."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        d = cfg.d_model
        self.decay = 0.5 + 0.4 * layer / max(cfg.n_layers - 1, 1)
        self.in_proj = nn.Linear(d, d, bias=False)
        self.norm = Norm(d, cfg.norm_type, cfg.norm_eps)
        self.out_proj = nn.Linear(d, d, bias=False)

    def forward(self, x, state=None, pos=0, cu_seqlens=None, *, scale):
        if cu_seqlens is not None:
            raise ValueError("toy: no packed documents")
        u = self.in_proj(x)
        T = x.shape[1]
        t = torch.arange(T, dtype=x.dtype)
        w = torch.tril((1 - self.decay) * self.decay ** (t[:, None] - t[None, :]).clamp_min(0))
        prev = None if state is None else state.get("h")
        h = torch.einsum("ts,bsd->btd", w, u)
        if prev is not None:
            h = h + self.decay ** (t + 1)[None, :, None] * prev[:, None, :]
        if state is not None:
            state["h"] = h[:, -1]
        return self.out_proj(self.norm(h * scale))


class LayerScales(ModelExtra):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.scales = nn.Parameter(torch.ones(cfg.n_layers))

    def layer_inputs(self, n_layers, device):
        return [{"scale": self.scales[i]} for i in range(n_layers)]


def toy_paper_params(cfg):
    l, d, g = cfg.n_layers, cfg.d_model, cfg.d_glu
    return 2 * l * d * d + 3 * l * d * g


def toy_layer_flops(cfg, n):
    d, g = cfg.d_model, cfg.d_glu
    return 3 * (4 * n * d * d + 3 * n * d) + 18 * n * d * g + 3 * n * g


TOY = ArchSpec(name="toy", title="Toy EMA", token_mixer=EmaMixer, channel_mixer=sglu, default_norm="srmsnorm",
               paper_params=toy_paper_params, layer_flops=toy_layer_flops,
               extra_params=lambda cfg: cfg.n_layers, extras={"layer_scales": LayerScales}, aliases=("ema",),
               describe=lambda model: [f"toy decays: {[b.token_mixer.decay for b in model.blocks]}"])


@pytest.fixture
def toy():
    register_arch(TOY)
    yield TOY
    unregister_arch("toy")


def test_toy_architecture_builds_and_counts(toy):
    cfg = model_config("EMA", "tiny", vocab_size=256)
    assert cfg.arch == "toy" and cfg.norm_type == "srmsnorm" and "toy" in arch_names()
    model = build_model("toy", "tiny", vocab_size=256)
    l, d, g, v = cfg.n_layers, cfg.d_model, cfg.d_glu, cfg.vocab_size
    # by hand: in/out projections 2d^2, SGLU 3dg per layer, one scale per layer, the tied embedding
    assert sum(p.numel() for p in model.parameters()) == l * (2 * d * d + 3 * d * g) + l + v * d
    assert exact_params(cfg)["total"] == l * (2 * d * d + 3 * d * g) + l + v * d
    n, b = 64, 3
    assert flops_per_step(cfg, b, n) == b * l * (3 * (4 * n * d * d + 3 * n * d) + 18 * n * d * g + 3 * n * g) \
        + 12 * b * n * d * v
    assert "layer_scales.scales" in model.state_dict()
    # incremental decoding through the cache agrees with the full forward
    x = torch.randint(0, 256, (2, 9))
    model.eval()
    full = model(x)
    cache = model.new_cache()
    steps = torch.cat([model(x[:, :5], cache=cache), *(model(x[:, i:i + 1], cache=cache) for i in range(5, 9))], 1)
    torch.testing.assert_close(steps, full, rtol=1e-5, atol=1e-5)


def test_toy_architecture_trains_through_the_trainer(toy, tmp_path, capsys):
    data = make_dataset(tmp_path / "data", docs=60)
    run = tmp_path / "run"
    train_in_process(run_flags(run, data, 12, "--save-every", "0", arch="ema", seq_len=32))
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 12
    losses = [r["loss"] for r in rows]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3, losses  # it learns
    config = json.loads((run / "config.json").read_text())
    assert config["arch"] == config["model"]["arch"] == "toy"  # the alias resolved to the registry name
    assert "toy decays: [0.5, 0.9]" in capsys.readouterr().out  # the spec's describe() is logged at start
    # the exported weights load back into the same function
    model = build_model("toy", "tiny", vocab_size=256)
    path = save_pretrained(model, tmp_path / "export")
    back = load_pretrained(path)
    x = torch.randint(0, 256, (1, 7))
    torch.testing.assert_close(back(x), model.eval()(x))


def test_registry_errors(toy):
    with pytest.raises(ValueError, match=r"already registered"):
        register_arch(TOY)
    with pytest.raises(ValueError, match=r"unknown arch 'gpt'; choose from llama, tnl, hgrn2, cos2, toy"):
        canonical_arch("gpt")
    with pytest.raises(ValueError, match="built-in"):
        unregister_arch("tnl")
    assert get_arch("CosFormer2").name == "cos2" and get_arch("transnormerllm").name == "tnl"


def test_unregistered_architecture_is_refused_by_the_run_config():
    from pretrain.config import parse_config
    from pretrain.errors import ConfigError
    with pytest.raises(ConfigError, match="--arch 'toy'"):
        parse_config(["--arch", "toy"])


@pytest.mark.parametrize("arch,kwarg", [("llama", "cu_seqlen"), ("tnl", "decays"), ("hgrn2", "lower_bounds"),
                                        ("cos2", "position")])
def test_mixers_refuse_misspelled_keywords(arch, kwarg):
    model = build_model(arch, "tiny", vocab_size=64)
    x = torch.randn(1, 4, model.config.d_model)
    inputs = {"lower_bound": torch.zeros(model.config.d_model)} if arch == "hgrn2" else {}
    model.blocks[0].token_mixer(x, **inputs)  # the right keywords work
    with pytest.raises(TypeError, match=kwarg):
        model.blocks[0].token_mixer(x, **inputs, **{kwarg: None})


def test_specs_hold_the_paper_facts():
    """The four built-in specs against the paper: the fitted laws of its Table 3 and the layer counts
    of its 410M row (the parameter and FLOPs formulas are checked against its tables in test_models)."""
    assert arch_names()[:4] == ("llama", "tnl", "hgrn2", "cos2")
    assert get_arch("hgrn2").paper_law["L"] == (3.4788, -0.0753)
    assert [model_config(a, "410m").n_layers for a in ("llama", "tnl", "hgrn2", "cos2")] == [26, 25, 26, 25]
    assert [get_arch(a).context_limited for a in ("llama", "tnl", "hgrn2", "cos2")] == [True, False, False, False]
