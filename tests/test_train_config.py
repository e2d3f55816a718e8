"""Run config -> DeepSpeed config: batch arithmetic (the 7B-on-64-GPUs case), the refusals and their
messages, the user-JSON merge, the CLI flags, and Slurm-derived ranks. Fast: no training."""
from __future__ import annotations

import json

import pytest

from pretrain.config import PAPER_GLOBAL_BATCH_TOKENS, gradient_accumulation, parse_config
from pretrain.deepspeed_config import build_deepspeed_config, generate_deepspeed_config, main, merge_user_config

SEQ = 8192


def cfg_7b(*flags: str):
    return parse_config(["--arch", "tnl", "--size", "7b", "--zero", "3", *flags])


def test_7b_paper_batch_is_refused_on_64_gpus_with_alternatives():
    cfg = cfg_7b("--micro-batch", "1")
    assert cfg.train.seq_len == SEQ and cfg.train.global_batch_tokens == PAPER_GLOBAL_BATCH_TOKENS == 480 * SEQ
    with pytest.raises(ValueError) as err:
        generate_deepspeed_config(cfg, world_size=64, precision="bf16")
    msg = str(err.value)
    # 480 = 64 x 7.5: no micro-batch can reach it; the message says so and names reachable batches
    assert "cannot be split evenly over 64 ranks" in msg
    assert "448 or 512" in msg and "--allow-inexact-batch" in msg
    assert "60" in msg  # 480 sequences divide evenly over 60 ranks


@pytest.mark.parametrize("micro", [1, 2, 4, 8])
def test_7b_on_64_gpus_with_a_reachable_global_batch(micro):
    cfg = cfg_7b("--micro-batch", str(micro), "--global-batch-tokens", str(512 * SEQ))
    ds = generate_deepspeed_config(cfg, world_size=64, precision="bf16")
    assert ds["train_micro_batch_size_per_gpu"] == micro
    assert ds["gradient_accumulation_steps"] * micro * 64 == 512
    assert ds["train_batch_size"] == 512
    assert ds["zero_optimization"]["stage"] == 3
    assert ds["gradient_clipping"] == 1.0
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    assert "bf16" not in ds  # fp32 parameters, bf16 compute (as the plain path)


def test_7b_on_64_gpus_inexact_allowed_uses_the_nearest_batch():
    cfg = cfg_7b("--micro-batch", "1", "--allow-inexact-batch")
    ds = generate_deepspeed_config(cfg, world_size=64, precision="bf16")
    assert ds["train_batch_size"] == 64 * 1 * ds["gradient_accumulation_steps"]
    assert abs(ds["train_batch_size"] - 480) <= 32  # round(480 / 64) = 8 -> 512


def test_7b_paper_batch_on_60_gpus_and_a_bad_micro_batch():
    cfg = cfg_7b("--micro-batch", "2")
    ds = generate_deepspeed_config(cfg, world_size=60, precision="bf16")
    assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (480, 480 // 60 // 2)
    with pytest.raises(ValueError, match=r"use --micro-batch 4 \(valid: 1, 2, 4, 8\)"):
        generate_deepspeed_config(cfg_7b("--micro-batch", "5"), world_size=60, precision="bf16")


def test_gradient_accumulation_names_a_valid_micro_batch():
    with pytest.raises(ValueError, match=r"use --micro-batch 3 \(valid: 1, 2, 3, 6\)"):
        gradient_accumulation(12, 2, 4)
    assert gradient_accumulation(12, 2, 3) == 2


def test_zero_stages_and_fp32():
    for stage in (1, 2, 3):
        cfg = parse_config(["--size", "tiny", "--zero", str(stage), "--micro-batch", "2"])
        ds = generate_deepspeed_config(cfg, world_size=2, precision="fp32")
        assert ds["zero_optimization"]["stage"] == stage
        assert "torch_autocast" not in ds and "bf16" not in ds
        assert ds["train_batch_size"] == cfg.global_batch


def test_user_json_merges_and_refuses_conflicts(tmp_path):
    cfg = parse_config(["--size", "tiny", "--zero", "2", "--micro-batch", "2"])
    gen = generate_deepspeed_config(cfg, world_size=2, precision="bf16")
    merged = merge_user_config(gen, {"zero_optimization": {"reduce_bucket_size": 1234},
                                     "train_micro_batch_size_per_gpu": "auto", "gradient_clipping": 1.0})
    assert merged["zero_optimization"]["reduce_bucket_size"] == 1234
    assert merged["zero_optimization"]["stage"] == 2  # untouched keys survive the merge
    assert merged["train_micro_batch_size_per_gpu"] == 2
    with pytest.raises(ValueError, match="--micro-batch"):
        merge_user_config(gen, {"train_micro_batch_size_per_gpu": 4})
    with pytest.raises(ValueError, match="--zero 3"):
        merge_user_config(gen, {"zero_optimization": {"stage": 3}})
    with pytest.raises(ValueError, match="optimizer"):
        merge_user_config(gen, {"optimizer": {"type": "Adam"}})
    # DeepSpeed's own bf16 weights replace torch autocast
    bf16 = merge_user_config(gen, {"bf16": {"enabled": True}})
    assert bf16["bf16"]["enabled"] and "torch_autocast" not in bf16
    # through the flag, from a file
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"overlap_comm": False}}))
    cfg.dist.deepspeed_config = str(path)
    assert build_deepspeed_config(cfg, 2, "bf16")["zero_optimization"]["overlap_comm"] is False


def test_shipped_example_json_is_accepted():
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    examples = sorted((root / "launch" / "configs" / "deepspeed").glob("*.json"))
    assert examples, "launch/configs/deepspeed/ should hold an example user JSON"
    for ex in examples:
        cfg = cfg_7b("--global-batch-tokens", str(512 * SEQ), "--deepspeed-config", str(ex))
        ds = build_deepspeed_config(cfg, 64, "bf16")
        assert ds["train_batch_size"] == 512 and ds["zero_optimization"]["stage"] == 3


def test_print_config_cli(capsys):
    rc = main(["--world-size", "64", "--arch", "tnl", "--size", "7b", "--zero", "3",
               "--global-batch-tokens", str(512 * SEQ), "--micro-batch", "2"])
    assert rc == 0
    ds = json.loads(capsys.readouterr().out)
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == \
        (512, 2, 512 // 64 // 2)
    assert main(["--world-size", "64", "--size", "7b", "--zero", "3"]) == 2
    assert "--allow-inexact-batch" in capsys.readouterr().err


def test_issue_flags_map_to_fields(tmp_path):
    yaml_path = tmp_path / "run.yaml"
    yaml_path.write_text("arch: hgrn2\nsize: 70m\ntrain: {seq_len: 4096, micro_batch: 2}\noptim: {lr: 1.0e-3}\n")
    cfg = parse_config(["--config", str(yaml_path), "--lr", "2e-4", "--zero", "2", "--data", "d.yaml",
                        "--global-batch-tokens", str(64 * 4096), "--warmup-steps", "10", "--max-steps", "7",
                        "--max-tokens", "99", "--out", "o", "--resume", "auto", "--activation-checkpointing",
                        "--compile", "--deepspeed-config", "x.json"])
    assert (cfg.arch, cfg.size, cfg.data, cfg.out, cfg.resume) == ("hgrn2", "70m", "d.yaml", "o", "auto")
    assert cfg.train.seq_len == 4096 and cfg.train.micro_batch == 2          # from YAML
    assert cfg.optim.lr == 2e-4                                              # flag beats YAML
    assert cfg.train.global_batch_tokens == 64 * 4096 and cfg.optim.warmup_steps == 10
    assert (cfg.train.max_steps, cfg.train.max_tokens) == (7, 99)
    assert cfg.train.activation_checkpointing and cfg.train.compile
    assert cfg.dist.zero == 2 and cfg.dist.deepspeed_config == "x.json"
    d = parse_config(["--size", "70m"])
    assert (d.train.seq_len, d.train.global_batch_tokens, d.optim.lr) == (8192, 480 * 8192, 3e-4)


def test_slurm_ranks_and_master_addr(monkeypatch):
    import os
    from pretrain.distributed import dist_env, first_host, slurm_master
    # dist_env exports RANK/... under srun: give it a private environment so nothing leaks into other tests
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")})
    monkeypatch.setenv("SLURM_PROCID", "13")
    monkeypatch.setenv("SLURM_NTASKS", "64")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "64")
    monkeypatch.setenv("SLURM_LOCALID", "5")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[007-014],login2")
    monkeypatch.setenv("SLURM_JOB_ID", "123456")
    env = dist_env("cpu")
    assert (env.rank, env.world_size, env.local_rank) == (13, 64, 5)
    addr, port = slurm_master()
    assert addr == "gpu007" and 1024 < port < 65536
    assert (os.environ["RANK"], os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]) == ("13", "gpu007", str(port))
    # a plain process in an salloc shell (no srun step) stays a single process
    del os.environ["SLURM_STEP_NUM_TASKS"]
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        del os.environ[k]
    assert dist_env("cpu").world_size == 1
    assert first_host("node-a1,node-b2") == "node-a1"
    assert first_host("n[3,5-6]x") == "n3x"
    assert first_host("rack1-[02-03]") == "rack1-02"


def test_batch_errors_name_the_values_a_preset_set():
    """Only --seq-len given with a CPU size: the error says that the preset, not the user, set the other
    batch values, and which flags to pass."""
    from pretrain.config import ConfigError
    with pytest.raises(ConfigError, match=r"the tiny preset set --global-batch-tokens 512, --micro-batch 4, "
                                          r"which no flag gave"):
        parse_config(["--arch", "tnl", "--size", "tiny", "--seq-len", "1024"])
    with pytest.raises(ConfigError) as err:  # every value given: nothing to blame on the preset
        parse_config(["--arch", "tnl", "--size", "tiny", "--seq-len", "1024", "--global-batch-tokens", "1000",
                      "--micro-batch", "1"])
    assert "preset" not in str(err.value)


@pytest.mark.parametrize("arch,size", [("TNL", "1B"), ("transnormer", "1b"), ("TransNormerLLM", "Tiny"),
                                       ("CosFormer2", "70M"), ("LLaMA", "7b")])
def test_arch_and_size_spellings_resolve_to_the_registry_names(arch, size):
    """Flags are case-insensitive and take aliases; the run config holds the registry's names, so the
    run directory and config.json are the same whatever the spelling (a `--resume auto` spelt `--arch TNL`
    finds the run started as `--arch tnl`)."""
    cfg = parse_config(["--arch", arch, "--size", size])
    expected = {"tnl": "tnl", "transnormer": "tnl", "transnormerllm": "tnl", "cosformer2": "cos2", "llama": "llama"}
    assert (cfg.arch, cfg.size) == (expected[arch.lower()], size.lower())
    assert cfg.run_dir.name == f"{expected[arch.lower()]}-{size.lower()}"
    assert cfg.to_dict()["arch"] == cfg.to_dict()["model"]["arch"] == cfg.arch


def test_a_runs_config_json_trains_that_run_again(tmp_path):
    """`--config RUN/config.json --out NEW` trains the run again: the same config.json (but out) and the same
    losses at every step as the first run, model overrides and a changed optimizer setting included. Flags
    on top still win; a config.json whose derived global_batch was edited against its token count is refused;
    an edited `model` section takes effect as overrides."""
    from checkpoint_utils import losses, make_dataset, run_flags, run_pretrain
    data = make_dataset(tmp_path / "data")
    first = tmp_path / "first"
    run_pretrain(run_flags(first, data, 3, "--model", "norm_eps=1e-5", "--beta2", "0.99", "--save-every", "0"))
    again = tmp_path / "again"
    run_pretrain(["--config", str(first / "config.json"), "--out", str(again), "--save-every", "0"])
    a, b = json.loads((first / "config.json").read_text()), json.loads((again / "config.json").read_text())
    assert a.pop("out") != b.pop("out") and a == b
    assert a["model"]["norm_eps"] == 1e-5 and a["optim"]["beta2"] == 0.99
    assert losses(again) == losses(first) and len(losses(first)) == 3

    cfg = parse_config(["--config", str(first / "config.json"), "--lr", "1e-3", "--max-steps", "5"])
    assert cfg.optim.lr == 1e-3 and cfg.train.max_steps == 5 and cfg.model().norm_eps == 1e-5
    edited = dict(a, model=dict(a["model"], n_layers=3))
    (tmp_path / "edited.json").write_text(json.dumps(edited))
    assert parse_config(["--config", str(tmp_path / "edited.json")]).model().n_layers == 3
    bad = dict(a, train=dict(a["train"], global_batch=a["train"]["global_batch"] + 1))
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="train.global_batch .* disagrees with train.global_batch_tokens"):
        parse_config(["--config", str(tmp_path / "bad.json")])


def test_user_json_under_sp_may_give_the_global_batch_in_sequences(tmp_path):
    """Under --sp 2 on 4 ranks (2 data-parallel groups), a user JSON's train_batch_size may be the run's global
    batch in sequences (what the user means) or DeepSpeed's count of segments (2x it); another value is refused,
    naming both."""
    cfg = parse_config(["--size", "tiny", "--zero", "1", "--micro-batch", "1", "--seq-len", "128",
                        "--global-batch-tokens", str(4 * 128), "--sp", "2"])
    sequences = 4                       # --global-batch-tokens / --seq-len
    path = tmp_path / "ds.json"
    cfg.dist.deepspeed_config = str(path)
    for given in (sequences, 2 * sequences, "auto"):
        path.write_text(json.dumps({"train_batch_size": given}))
        assert build_deepspeed_config(cfg, 4, "bf16")["train_batch_size"] == 2 * sequences  # 4 ranks x 1 x 2
    path.write_text(json.dumps({"train_batch_size": 6}))
    with pytest.raises(ValueError, match=r"global batch is 4 sequences \(8 for DeepSpeed.*--sp 2"):
        build_deepspeed_config(cfg, 4, "bf16")


def test_deepspeed_low_precision_weights_name_what_they_round():
    """DeepSpeed's bf16 engine casts every parameter: a config that enables it names the parameters the
    model keeps fp32 otherwise (cos2's angles and TPE decays, HGRN2's bounds); autocast, and a model
    without such parameters, say nothing."""
    pytest.importorskip("deepspeed")
    from models import build_model
    from pretrain.deepspeed_module import low_precision_weights_warning
    cos2, llama = build_model("cos2", "tiny"), build_model("llama", "tiny")
    n = cos2.config.n_layers
    text = low_precision_weights_warning({"bf16": {"enabled": True}}, cos2)
    assert text and "rounds tpe.decay_logit, blocks.0.token_mixer.theta" in text and f"({n + 1} parameters" in text
    assert "bf16" in low_precision_weights_warning({"bf16": {"enabled": True}}, build_model("hgrn2", "tiny"))
    assert low_precision_weights_warning({"torch_autocast": {"enabled": True}}, cos2) is None
    assert low_precision_weights_warning({"bf16": {"enabled": False}}, cos2) is None
    assert low_precision_weights_warning({"bf16": {"enabled": True}}, llama) is None


def test_yaml_words_read_as_booleans_keep_their_choice(tmp_path):
    """YAML 1.1 reads `off` / `no` / `on` as booleans: fields whose choices are words get the word back (was
    "'False': not allowed; choose one of auto, off"); a boolean no choice spells is still refused."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  grad_accum_fusion: off\n  compile: no\n")
    cfg = parse_config(["--config", str(path)])
    assert cfg.train.grad_accum_fusion == "off" and cfg.train.compile == "false"
    path.write_text("train:\n  compile: on\n")
    assert parse_config(["--config", str(path)]).train.compile == "true"
    path.write_text("train:\n  precision: off\n")
    with pytest.raises(Exception, match="precision.*'False': not allowed"):
        parse_config(["--config", str(path)])


def test_a_key_given_twice_in_a_config_file_is_refused_naming_both_lines(tmp_path):
    """PyYAML keeps the last of two equal keys without a word: a second `lr:` further down a config would
    silently replace the first. Both the pretrain and the study config loaders refuse it."""
    from pretrain.errors import describe
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 1.0e-3\n  warmup_steps: 10\n  lr: 3.0e-4\n")
    with pytest.raises(Exception) as err:
        parse_config(["--config", str(path)])
    assert describe(err.value).endswith("line 4, column 3: while reading a mapping found the key 'lr' a second "
                                        "time (first at line 2); keep one of them")
    path.write_text("optim:\n  lr: 1.0e-3\ntrain:\n  seq_len: 64\n")   # distinct keys load as before
    assert parse_config(["--config", str(path)]).optim.lr == 1.0e-3
    from scaling.study.config import StudyConfigError, load_study
    study = tmp_path / "s.yaml"
    study.write_text("name: a\narchs: [tnl]\nname: b\n")
    with pytest.raises(StudyConfigError, match=r"line 3.*the key 'name' a second time \(first at line 1\)"):
        load_study(study)
