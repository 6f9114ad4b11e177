from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from typing import ClassVar, Literal

import pytest

from raytrain_common.cli import add_config_options, config_from_args, option
from raytrain_common.configs import (
    ConfigError,
    DataLocation,
    RayTrainSettings,
    RunLocation,
    build_run_config,
    build_scaling_config,
    build_torch_config,
    check_batch_splits_for_every_worker_count,
)


@dataclass(kw_only=True)
class Example(RayTrainSettings):
    lr: float = option(0.1, "learning rate")
    clip: float | None = option(None, "clip norm")
    bf16: bool = option(False, "bf16")
    mode: Literal["fast", "slow"] = option("fast", "mode")


PRESETS = {"cpu": Example(), "gpu": dataclasses.replace(Example(), use_gpu=True, bf16=True)}


def parse(*argv: str) -> Example:
    parser = argparse.ArgumentParser()
    add_config_options(parser, Example, PRESETS)
    return config_from_args(parser.parse_args(argv), Example, PRESETS)


def test_first_preset_is_the_default() -> None:
    assert parse() == PRESETS["cpu"]


def test_flags_override_the_chosen_preset() -> None:
    config = parse(
        "--preset", "gpu", "--no-bf16", "--lr", "0.5", "--clip", "1.0", "--num-workers", "4"
    )
    assert (config.use_gpu, config.bf16, config.lr, config.clip, config.num_workers) == (
        True,
        False,
        0.5,
        1.0,
        4,
    )


@dataclass
class Renamed:
    validation_fraction: float = option(0.1, "share held out", deprecated=["--val-fraction"])


def test_a_flags_former_name_still_works_for_a_version_and_says_its_new_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = argparse.ArgumentParser(prog="tool")
    add_config_options(parser, Renamed)
    read = config_from_args(parser.parse_args(["--val-fraction", "0.2"]), Renamed)
    assert read.validation_fraction == 0.2
    assert "--val-fraction is deprecated" in capsys.readouterr().err
    read = config_from_args(parser.parse_args(["--validation-fraction", "0.3"]), Renamed)
    assert read.validation_fraction == 0.3 and capsys.readouterr().err == ""


def test_optional_flag_takes_none() -> None:
    assert parse("--clip", "1.0").clip == 1.0
    assert parse("--clip", "none").clip is None


def test_literal_flag_refuses_other_values(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--mode", "medium")
    assert "invalid choice: 'medium'" in capsys.readouterr().err


def test_help_shows_each_presets_default() -> None:
    parser = argparse.ArgumentParser()
    add_config_options(parser, Example, PRESETS)
    text = parser.format_help()
    assert "--use-gpu" in text and "(default: cpu: False, gpu: True)" in text


@dataclass(kw_only=True)
class PredictExample(RunLocation, DataLocation):
    """A command without presets: `predict`-like, with an input file as its positional argument."""

    data_folder: ClassVar[str] = "data/images"
    run_name: str = option("vision", "run to read")
    input: str = option("-", "file to read", positional=True)
    count: int = option(40, "how many")


def parse_command(*argv: str) -> PredictExample:
    parser = argparse.ArgumentParser()
    add_config_options(parser, PredictExample)
    return config_from_args(parser.parse_args(argv), PredictExample)


def test_a_command_without_presets_takes_the_class_defaults_and_a_positional_input() -> None:
    assert parse_command() == PredictExample()
    config = parse_command("in.txt", "--count", "3", "--run-name", "r2")
    assert (config.input, config.count, config.run_name) == ("in.txt", 3, "r2")
    parser = argparse.ArgumentParser()
    add_config_options(parser, PredictExample)
    text = parser.format_help()
    assert "--preset" not in text
    assert "path>/data/images" in text  # the class's own data folder, named once


def test_every_command_computes_the_data_and_run_folders_alike() -> None:
    """prepare writes where train reads: both ask `resolved_data_dir()`, and a storage URI's options
    stay at its end (`posixpath.join` would put the folders after them)."""
    uri = "s3://bucket/runs?endpoint_override=127.0.0.1:9000&scheme=http"
    config = PredictExample(storage_path=uri)
    assert config.resolved_data_dir() == (
        "s3://bucket/runs/data/images?endpoint_override=127.0.0.1:9000&scheme=http"
    )
    assert (
        config.run_dir() == "s3://bucket/runs/vision?endpoint_override=127.0.0.1:9000&scheme=http"
    )
    assert PredictExample(data_dir="/elsewhere").resolved_data_dir() == "/elsewhere"


def test_scaling_config_fixed_and_elastic() -> None:
    fixed = build_scaling_config(Example(num_workers=3, cpus_per_worker=0.5))
    assert fixed.num_workers == 3
    assert fixed.resources_per_worker == {"CPU": 0.5}
    elastic = build_scaling_config(
        Example(num_workers=8, min_workers=2, use_gpu=True, accelerator_type="H100")
    )
    assert elastic.num_workers == (2, 8)
    assert elastic.resources_per_worker == {"CPU": 1.0, "GPU": 1.0}
    assert elastic.accelerator_type == "H100"
    assert elastic.elastic_resize_monitor_interval_s == 60.0
    quick = Example(num_workers=2, min_workers=1, elastic_resize_monitor_interval_s=5)
    assert build_scaling_config(quick).elastic_resize_monitor_interval_s == 5


def test_an_elastic_runs_global_batch_must_split_over_every_worker_count() -> None:
    check_batch_splits_for_every_worker_count(120, Example(num_workers=5, min_workers=2))
    check_batch_splits_for_every_worker_count(64, Example(num_workers=4, min_workers=4), 2)
    with pytest.raises(ConfigError, match=r"over \[3\] worker\(s\) × 1 .* multiple of 12"):
        check_batch_splits_for_every_worker_count(64, Example(num_workers=4, min_workers=2))
    with pytest.raises(ConfigError, match=r"global_batch_size=30 does not divide evenly over 4"):
        check_batch_splits_for_every_worker_count(30, Example(num_workers=4))


def test_run_and_torch_configs() -> None:
    settings = Example(run_name="r", storage_path="/tmp/s", num_to_keep=3, max_failures=2)
    run = build_run_config(settings, score_attribute="acc", score_order="max")
    assert (run.name, run.storage_path) == ("r", "/tmp/s")
    assert run.checkpoint_config.num_to_keep == 3
    assert run.checkpoint_config.checkpoint_score_attribute == "acc"
    assert run.failure_config.max_failures == 2
    assert build_torch_config(settings).backend == "gloo"
    assert build_torch_config(Example(use_gpu=True)).backend == "nccl"
    assert build_torch_config(Example(timeout_s=60)).timeout_s == 60  # not a deadline: a setting


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"num_workers": 0}, "num_workers=0: it must be at least 1"),
        (
            {"num_workers": 2, "min_workers": 3},
            "min_workers=3 must lie between 1 and num_workers=2",
        ),
        ({"cpus_per_worker": 0}, "cpus_per_worker=0: it must be above 0"),
        ({"num_to_keep": 0}, "num_to_keep=0: keep at least 1 checkpoint"),
    ],
)
def test_bad_cluster_settings_are_named(changes: dict[str, int], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Example(**changes).validate_cluster_settings()


def test_needed_resources_use_the_smallest_group() -> None:
    settings = Example(num_workers=4, min_workers=2, use_gpu=True, cpus_per_worker=2)
    assert settings.needed_resources() == {"CPU": 4, "GPU": 2}
