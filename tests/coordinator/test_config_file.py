"""Config files: defaults < TOML < flags, strict keys and types, and the generated example stays in sync."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest

from asyncrl.coordinator.cli import build_parser
from asyncrl.coordinator.config import ConfigError, CoordinatorConfig
from asyncrl.coordinator.config_file import EXAMPLE_PATH, example_toml, load_toml, overrides_from_args, resolve_config
from asyncrl.coordinator.loss import LossConfig

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
