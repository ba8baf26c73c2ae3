"""Config files: defaults < TOML < flags, strict keys and types, and the generated example stays in sync."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from asyncrl.coordinator.cli import build_parser
from asyncrl.coordinator.config import ConfigError, CoordinatorConfig
from asyncrl.coordinator.config_file import EXAMPLE_PATH, example_toml, load_toml, overrides_from_args, resolve_config
from asyncrl.coordinator.learner.loss import LossConfig

REPO = Path(__file__).resolve().parents[2]


def cli(*flags: str) -> dict:
    return overrides_from_args(build_parser().parse_args(["run", *flags]))


def test_no_file_no_flags_gives_the_defaults():
    cfg = resolve_config({}, cli())
    default = CoordinatorConfig()
    assert dataclasses.replace(cfg, loss=default.loss) == dataclasses.replace(default, loss=default.loss)
    assert cfg.loss.max_completion_length == default.max_new_tokens  # dr_grpo normaliser follows the cap


def test_file_beats_defaults_and_flags_beat_the_file():
    file_values = {"max_steps": 7, "group_size": 4, "run_dir": "from-file", "loss": {"epsilon": 0.1, "beta": 0.5}}
    cfg = resolve_config(file_values, cli("--group-size", "8", "--beta", "0.25"))
    assert cfg.max_steps == 7                       # file only
    assert cfg.run_dir == "from-file"
    assert cfg.group_size == 8                      # flag over file
    assert cfg.loss.epsilon == 0.1                  # nested: the file's key survives a flag for a sibling key
    assert cfg.loss.beta == 0.25
    assert cfg.lr == CoordinatorConfig.lr           # neither


def test_flags_left_unset_do_not_override_the_file():
    cfg = resolve_config({"port": 31337, "announce": ["/ip4/203.0.113.5/tcp/31337"], "dashboard": False}, cli())
    assert cfg.port == 31337 and cfg.announce == ("/ip4/203.0.113.5/tcp/31337",) and cfg.dashboard is False


def test_chunk_bytes_flag_sets_the_adapter_chunk_size_within_its_bounds():
    assert resolve_config({"chunk_bytes": 65536}, cli("--chunk-bytes", "4096")).chunk_bytes == 4096
    assert resolve_config({"chunk_bytes": 65536}, cli()).chunk_bytes == 65536
    with pytest.raises(ConfigError):
        resolve_config({}, cli("--chunk-bytes", "100"))


def test_negative_means_none_for_optional_fields_in_files_and_flags():
    assert resolve_config({"max_staleness": -1}).max_staleness is None
    assert resolve_config({}, cli("--max-staleness", "-1")).max_staleness is None
    assert resolve_config({"max_staleness": 2}).max_staleness == 2


def test_lora_alpha_follows_rank_unless_given():
    assert resolve_config({"lora_r": 8}).lora_alpha == 16.0
    assert resolve_config({"lora_r": 8, "lora_alpha": 4}).lora_alpha == 4.0


@pytest.mark.parametrize("values, key", [
    ({"max_stepz": 3}, "max_stepz"),
    ({"loss": {"epsilonn": 0.1}}, "epsilonn"),
])
def test_unknown_keys_are_errors_that_name_the_key(values, key):
    with pytest.raises(ConfigError) as info:
        resolve_config(values)
    assert key in str(info.value)


@pytest.mark.parametrize("values", [
    {"max_steps": "10"}, {"max_steps": 1.5}, {"max_steps": True}, {"lr": "fast"}, {"announce": "/ip4/x"},
    {"dashboard": 1}, {"loss": {"correction": "bogus"}}, {"loss": 3}, {"report_to": ["mlflow"]},
    {"dashboard_port": 70000},
])
def test_wrong_types_and_values_are_errors(values):
    with pytest.raises(ConfigError):
        resolve_config(values)


def test_load_toml_reports_syntax_errors_and_missing_files(tmp_path):
    (tmp_path / "bad.toml").write_text("max_steps = = 3\n")
    with pytest.raises(ConfigError):
        load_toml(tmp_path / "bad.toml")
    with pytest.raises(ConfigError):
        load_toml(tmp_path / "missing.toml")


def test_the_checked_in_example_is_complete_and_loads():
    """Fails when a field is added without regenerating the example:
    `asyncrl-coordinator example-config > configs/coordinator.example.toml`."""
    path = REPO / EXAMPLE_PATH
    values = load_toml(path)
    top = {f.name for f in dataclasses.fields(CoordinatorConfig)}
    assert set(values) == top, "regenerate: asyncrl-coordinator example-config > " + EXAMPLE_PATH
    assert set(values["loss"]) == {f.name for f in dataclasses.fields(LossConfig)}
    cfg = resolve_config(values, source=str(path))
    assert cfg.model == CoordinatorConfig.model and cfg.max_staleness == CoordinatorConfig.max_staleness


def test_every_field_in_the_example_carries_a_comment():
    lines = example_toml().splitlines()
    for i, line in enumerate(lines):
        if "=" in line and not line.startswith("#") and not line.startswith("["):
            assert lines[i - 1].startswith("#"), f"field without a comment: {line}"
    tomllib.loads(example_toml())


# ---- real-model defaults, the tiny model's toy preset, and the model presets -------------------------
def test_defaults_are_for_a_real_model_and_tiny_gets_its_toy_preset():
    from asyncrl.coordinator.config import TINY_PRESET

    real = resolve_config({}, cli())
    assert real.model.startswith("Qwen/") and real.max_new_tokens >= 512
    assert real.lease_max_s >= 600  # long real work lives on renewals (lease_timeout_s bounds a silent holder)
    assert real.task_reward == "math" and real.lr < 1e-4
    tiny = resolve_config({}, cli("--model", "tiny"))
    assert {k: getattr(tiny, k) for k in TINY_PRESET} == TINY_PRESET
    assert tiny.loss.max_completion_length == TINY_PRESET["max_new_tokens"]
    # anything explicit beats the preset: a file value, or a flag
    assert resolve_config({"model": "tiny", "max_new_tokens": 16}).max_new_tokens == 16
    assert resolve_config({"model": "tiny"}, cli("--lr", "0.01")).lr == 0.01
    # the preset belongs to the tiny model only
    assert resolve_config({"model": "/data/my-model"}).max_new_tokens == CoordinatorConfig.max_new_tokens


def test_the_named_smollm2_brings_its_cpu_sized_preset():
    from asyncrl.coordinator.config import SMOLLM2_PRESET

    small = resolve_config({}, cli("--model", "smollm2-135m-instruct"))
    top = {k: v for k, v in SMOLLM2_PRESET.items() if k != "loss"}
    assert {k: getattr(small, k) for k in top} == top
    assert {k: getattr(small.loss, k) for k in SMOLLM2_PRESET["loss"]} == SMOLLM2_PRESET["loss"]
    assert small.loss.max_completion_length == SMOLLM2_PRESET["max_new_tokens"]
    assert small.dtype == "auto"  # fp32 on a CPU, bf16 on a GPU (models/lora.py resolve_placement)
    # explicit values win, a [loss] table key by key: the preset's other loss settings stay
    mixed = resolve_config({"model": "smollm2-135m-instruct", "loss": {"mask_truncated": False}}, cli("--lr", "1e-3"))
    assert mixed.lr == 1e-3 and mixed.loss.mask_truncated is False
    assert mixed.loss.loss_type == SMOLLM2_PRESET["loss"]["loss_type"]
    assert resolve_config({"model": "/data/smollm2.gguf"}).max_new_tokens == CoordinatorConfig.max_new_tokens


PRESETS = sorted((REPO / "configs").glob("qwen2.5-*.toml"))


def test_there_is_a_preset_per_model_size():
    assert [p.name for p in PRESETS] == ["qwen2.5-0.5b-instruct.toml", "qwen2.5-1.5b-instruct.toml",
                                         "qwen2.5-7b-instruct.toml"]


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_each_preset_parses_and_validates(path):
    cfg = resolve_config(load_toml(path), cli(), source=str(path))
    size = path.stem.split("-")[1]  # "0.5b"
    assert cfg.model == f"Qwen/Qwen2.5-{size.upper()}-Instruct"
    assert cfg.loss.max_completion_length == cfg.max_new_tokens  # the normaliser follows the preset's cap
    assert cfg.inflight_groups >= cfg.groups_per_step and cfg.lease_timeout_s >= 300


def test_dry_run_resolves_a_preset_without_starting_anything(tmp_path):
    import json
    import subprocess
    import sys

    missing = subprocess.run([sys.executable, "-m", "asyncrl.coordinator.cli", "run", "--config", str(PRESETS[1]),
                              "--dry-run", "--task", str(tmp_path / "train.jsonl")], capture_output=True, text=True,
                             timeout=60)
    assert missing.returncode == 2 and "does not exist" in missing.stderr  # the preset's task file is yours to write
    (tmp_path / "train.jsonl").write_text('{"prompt": "1+1?", "answer": "2"}\n')
    r = subprocess.run([sys.executable, "-m", "asyncrl.coordinator.cli", "run", "--config", str(PRESETS[1]),
                        "--dry-run", "--max-steps", "3", "--task", str(tmp_path / "train.jsonl")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    resolved = json.loads(r.stdout)
    assert resolved["model"] == "Qwen/Qwen2.5-1.5B-Instruct" and resolved["max_steps"] == 3
    bad = subprocess.run([sys.executable, "-m", "asyncrl.coordinator.cli", "run", "--config", str(PRESETS[1]),
                          "--dry-run", "--group-size", "1"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr


def test_trl_grpoconfig_names_are_aliases_where_the_meaning_is_the_same():
    from asyncrl.coordinator.config_file import resolve_config

    cfg = resolve_config({"learning_rate": 3e-6, "num_generations": 8, "max_completion_length": 256, "beta": 0.04,
                          "loss_type": "dr_grpo", "temperature": 0.9}, source="trl.toml")
    assert (cfg.lr, cfg.group_size, cfg.max_new_tokens, cfg.loss.beta, cfg.loss.loss_type, cfg.temperature) == \
        (3e-6, 8, 256, 0.04, "dr_grpo", 0.9)
    assert cfg.loss.max_completion_length == 256  # dr_grpo's normaliser follows it, as TRL's does


def test_trl_sampling_names_set_the_knobs_volunteers_sample_with(tmp_path, capsys):
    import json

    from asyncrl.coordinator import cli
    from asyncrl.coordinator.config_file import resolve_config

    cfg = resolve_config({"top_p": 0.95, "top_k": 50, "min_p": 0.05, "repetition_penalty": 1.1, "temperature": 0.7},
                         source="trl.toml")
    assert (cfg.top_p, cfg.top_k, cfg.min_p, cfg.repetition_penalty, cfg.temperature) == (0.95, 50, 0.05, 1.1, 0.7)
    assert cli.main(["run", "--dry-run", "--model", "tiny", "--top-p", "0.9", "--top-k", "20", "--min-p", "0.1",
                     "--repetition-penalty", "1.2"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["top_p"], got["top_k"], got["min_p"], got["repetition_penalty"]) == (0.9, 20, 0.1, 1.2)


@pytest.mark.parametrize("values, needle", [
    ({"top_p": 0.0}, "top_p must be in"), ({"top_p": 1.5}, "top_p must be in"),
    ({"top_p": float("nan")}, "top_p must be in"), ({"top_k": -2}, "top_k must be >= 0"),
    ({"min_p": 1.5}, "min_p must be in"), ({"min_p": -0.1}, "min_p must be in"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in"),
    ({"repetition_penalty": 1e9}, "repetition_penalty must be in"),
    ({"top_k": 0.5}, "top_k"),  # a float where TRL has an int
])
def test_bad_sampling_knobs_stop_the_start_naming_the_knob(values, needle):
    from asyncrl.coordinator.config_file import resolve_config

    with pytest.raises(ConfigError, match=needle):
        resolve_config(values, source="trl.toml")


def test_bad_sampling_flag_exits_2_with_the_message(capsys):
    from asyncrl.coordinator import cli

    assert cli.main(["run", "--dry-run", "--model", "tiny", "--top-p", "0"]) == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err


@pytest.mark.parametrize("values, needle", [
    ({"per_device_train_batch_size": 8}, "groups_per_step"),
    ({"num_iterations": 2}, "trained once"),
    ({"learning_rate": 1e-5, "lr": 2e-5}, "both 'learning_rate'"),
])
def test_trl_names_that_mean_something_else_are_refused_naming_the_asyncrl_key(values, needle):
    from asyncrl.coordinator.config_file import resolve_config

    with pytest.raises(ConfigError, match=needle):
        resolve_config(values, source="trl.toml")


def test_several_config_files_merge_in_order_and_flags_win(tmp_path, capsys):
    import json

    from asyncrl.coordinator import cli

    (tmp_path / "a.toml").write_text('model = "tiny"\ngroup_size = 4\nlr = 1e-3\n[loss]\nbeta = 0.1\n')
    (tmp_path / "b.toml").write_text('group_size = 6\n[loss]\nepsilon = 0.3\n')
    assert cli.main(["run", "--dry-run", "--config", str(tmp_path / "a.toml"), "--config", str(tmp_path / "b.toml"),
                     "--lr", "5e-4", "--temperature", "0.7"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert (got["group_size"], got["lr"], got["loss"]["beta"], got["loss"]["epsilon"]) == (6, 5e-4, 0.1, 0.3)
    assert got["temperature"] == 0.7  # sampling temperature on the command line too
    (tmp_path / "c.toml").write_text('group_size = "six"\n')
    assert cli.main(["run", "--dry-run", "--config", str(tmp_path / "a.toml"), "--config", str(tmp_path / "c.toml")]) == 2
    assert "c.toml" in capsys.readouterr().err  # the error names the files it came from


def test_help_and_the_tasks_guide_state_the_configs_default_reward(capsys):
    """docs/tasks.md and `run --help` say which reward a record without one gets: the config's default, and the
    tiny model's preset."""
    import re

    from asyncrl.coordinator import cli
    from asyncrl.coordinator.config import TINY_PRESET, CoordinatorConfig

    want = (CoordinatorConfig().task_reward, TINY_PRESET["task_reward"])
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert re.search(r"--task-reward TASK_REWARD .*?\(default '(\w+)'; '(\w+)' for the tiny model\)", help_text).groups() == want
    guide = " ".join((REPO / "docs/tasks.md").read_text().split())
    assert re.search(r"default `task_reward`: `(\w+)`, or `(\w+)` under the tiny model", guide).groups() == want
