"""The training recipe's numbers against references computed here by hand (not by the code under test):
config values that would poison the first update, the peak FLOPs behind MFU, and the loss of a step
whose micro-batches hold different numbers of counted tokens. Fast: no training run."""
from __future__ import annotations

import math

import pytest

from pretrain.config import parse_config
from pretrain.errors import ConfigError


@pytest.mark.parametrize("flag", ["--lr", "--weight-decay", "--eps"])
@pytest.mark.parametrize("value", ["inf", "Infinity", "1e999"])
def test_infinite_optimizer_values_are_refused(flag: str, value: str):
    """AdamW with lr = inf (or weight decay inf: p *= 1 - lr*wd) makes every weight inf or NaN in the first
    update; eps = inf makes every update 0. An open upper bound is not a licence for +inf."""
    with pytest.raises(ConfigError, match=rf"^{flag} inf: must be a finite number"):
        parse_config(["--arch", "tnl", "--size", "tiny", flag, value])


def test_infinite_optimizer_values_are_refused_in_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("optim: {lr: .inf}\n")
    with pytest.raises(ConfigError, match=r"--lr \(optim.lr in .*run.yaml\) inf: must be a finite number"):
        parse_config(["--config", str(path)])


@pytest.mark.parametrize("flag,field", [("--grad-clip", "optim.grad_clip"), ("--spike-factor", "train.spike_factor")])
def test_infinity_where_it_means_no_limit(flag: str, field: str):
    """A clipping threshold of inf never clips; a spike factor of inf never flags a spike: both meaningful."""
    cfg = parse_config(["--arch", "tnl", "--size", "tiny", flag, "inf"])
    section, name = field.split(".")
    assert getattr(getattr(cfg, section), name) == math.inf


# dense bf16 tensor-core TFLOP/s from NVIDIA's datasheets (half of the printed "with sparsity" figure),
# keyed by what torch.cuda.get_device_name returns on each board
DATASHEET_BF16_DENSE = {
    "NVIDIA H100 80GB HBM3": 989e12,    # SXM5: 1,979 with sparsity
    "NVIDIA H100 PCIe": 756e12,         # 1,513 with sparsity
    "NVIDIA H100 NVL": 835e12,          # 1,671 with sparsity
    "NVIDIA H200": 989e12,              # SXM: 1,979 with sparsity
    "NVIDIA H200 NVL": 835e12,          # 1,671 with sparsity
    "NVIDIA GH200 480GB": 989e12,
    "NVIDIA H800 PCIe": 756e12,
    "NVIDIA H800": 989e12,
    "NVIDIA A100-SXM4-80GB": 312e12,
    "NVIDIA A100 80GB PCIe": 312e12,    # the A100's PCIe board keeps the SXM's tensor peak
    "NVIDIA B200": 2250e12,
}


@pytest.mark.parametrize("name", sorted(DATASHEET_BF16_DENSE))
def test_mfu_peak_per_gpu_board(name: str):
    """MFU divides by the board's own peak: a PCIe or NVL H100/H200 is not an SXM one (31% / 18% lower)."""
    from pretrain.metrics import peak_flops_of
    assert peak_flops_of(name) == DATASHEET_BF16_DENSE[name]


def test_mfu_peak_unknown_gpu_is_none():
    from pretrain.metrics import peak_flops_of
    assert peak_flops_of("NVIDIA L40S") is None and peak_flops_of("NVIDIA H20") is None


@pytest.mark.parametrize("world", [7, 64, 100])
@pytest.mark.parametrize("micro", [1, 2, 3, 4, 8, 16])
def test_refused_batch_suggests_only_reachable_alternatives(world: int, micro: int):
    """480 sequences that do not split over the ranks: every global batch and rank count the message offers
    with the same --micro-batch must reach a batch exactly (checked by hand: ranks x micro x accumulation)."""
    import re
    from pretrain.config import gradient_accumulation
    with pytest.raises(ValueError) as err:
        gradient_accumulation(480, world, micro)
    msg = str(err.value)
    batches = re.search(r"use a global batch of ([\d or]+) sequences", msg).group(1).split(" or ")
    for b in map(int, batches):
        assert b % (world * micro) == 0, (b, msg)
    ranks = re.search(r"run on ([\d or]+) ranks", msg)
    for w in map(int, ranks.group(1).split(" or ") if ranks else []):
        assert 480 % (w * micro) == 0, (w, msg)  # 480 = w x micro x accumulation, accumulation whole
        assert w * micro * gradient_accumulation(480, w, micro) == 480


def test_refused_batch_under_sp_counts_processes(tmp_path, monkeypatch):
    """8 processes with --sp 2 are 4 data-parallel groups: the refusal's arithmetic is over 4, and the
    message says how its rank counts translate into processes (4 groups x 2 = 8), before any rendezvous."""
    from pretrain.trainer import Trainer
    for k, v in (("RANK", "0"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "0")):
        monkeypatch.setenv(k, v)
    # 6 sequences over 4 groups: 1.5 a group, not reachable
    cfg = parse_config(["--arch", "tnl", "--size", "tiny", "--sp", "2", "--device", "cpu", "--seq-len", "128",
                        "--global-batch-tokens", str(6 * 128), "--micro-batch", "1", "--out", str(tmp_path / "run")])
    with pytest.raises(ValueError) as err:
        Trainer(cfg)
    msg = str(err.value)
    assert "cannot be split evenly over 4 ranks" in msg
    assert "with --sp 2 the ranks above are data-parallel groups: 8 ranks / --sp 2 = 4" in msg


# the parameters each architecture leaves undecayed, by name (docs/architectures.md: weight decay on
# linear and embedding matrices only)
UNDECAYED = {"llama": {"mixer_norm.weight", "channel_norm.weight", "final_norm.weight"}, "tnl": set(),
             "hgrn2": {"lower_bounds.bounds"}, "cos2": {"tpe.decay_logit", "tpe.in_weight", "token_mixer.theta"}}


@pytest.mark.parametrize("arch", sorted(UNDECAYED))
def test_weight_decay_groups(arch: str):
    import torch
    from models import build_model
    from pretrain.train_module import param_groups
    model = build_model(arch, "tiny")
    decay, no_decay = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    short = {".".join(names[id(p)].split(".")[-2:]) if names[id(p)].startswith("blocks.") else names[id(p)]
             for p in no_decay["params"]}
    assert short == UNDECAYED[arch]
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and model.embed.weight in decay["params"]
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


@pytest.mark.parametrize("arch", ["tnl", "hgrn2"])
def test_train_step_matches_a_float64_adamw_by_hand(arch: str):
    """Three optimizer steps of two micro-batches each (warm-up of 2 steps, clipping at 1.0 active) against
    a float64 copy updated by hand: loss = the mean over all tokens of the step, grad norm = the global L2
    norm of the averaged (not summed) gradient before clipping (each norm is above 1: clipping is active;
    without it the step-3 norm of TNL moves by 6e-5), AdamW with decoupled decay on matrices."""
    import copy
    import torch
    from models import build_model
    from pretrain.config import OptimConfig
    from pretrain.train_module import TorchTrainModule
    torch.manual_seed(0)
    model = build_model(arch, "tiny", n_layers=1, d_model=64, n_heads=1, d_glu=128, vocab_size=97)
    ref = copy.deepcopy(model).double()
    o = OptimConfig(lr=1e-3, warmup_steps=2, grad_clip=1.0, weight_decay=0.1)
    module = TorchTrainModule(model, o, torch.device("cpu"), "fp32")
    decayed = {n for n, p in ref.named_parameters() if p.dim() == 2}
    m = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    v = {n: torch.zeros_like(p) for n, p in ref.named_parameters()}
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        micro = [{"input_ids": torch.randint(0, 97, (2, 19), generator=g),
                  "targets": torch.randint(0, 97, (2, 19), generator=g)} for _ in range(2)]
        res = module.train_step(micro, step)
        ids = torch.cat([b["input_ids"] for b in micro])
        tg = torch.cat([b["targets"] for b in micro])
        ref.zero_grad()
        logits = ref.hidden_states(ids) @ ref.embed.weight.t()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 97), tg.reshape(-1))  # all 76 tokens
        loss.backward()
        norm = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ref.parameters()))
        lr = o.lr * (step + 1) / o.warmup_steps if step < o.warmup_steps else o.lr
        clip = min(1.0, o.grad_clip / (norm + 1e-6))
        assert norm > 1.0  # clipping is exercised
        with torch.no_grad():
            for n, p in ref.named_parameters():
                grad = p.grad * clip
                m[n] = o.beta1 * m[n] + (1 - o.beta1) * grad
                v[n] = o.beta2 * v[n] + (1 - o.beta2) * grad * grad
                if n in decayed:
                    p.mul_(1 - lr * o.weight_decay)
                mh, vh = m[n] / (1 - o.beta1 ** (step + 1)), v[n] / (1 - o.beta2 ** (step + 1))
                p.sub_(lr * mh / (vh.sqrt() + o.eps))
        assert res.loss == pytest.approx(loss.item(), rel=1e-6)
        assert res.grad_norm == pytest.approx(norm, rel=2e-5)
        assert module.optimizer.param_groups[0]["lr"] == pytest.approx(lr, rel=1e-15)
    for (n, p), q in zip(ref.named_parameters(), model.parameters()):
        # each step moves a weight by up to lr (1e-3); fp32 against float64 Adam differs by < 1e-5 here
        assert float((q.double() - p).abs().max()) < 3e-5, n
