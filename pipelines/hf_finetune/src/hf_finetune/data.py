"""This recipe's dataset: VADER's 23,703 human-rated sentences (the `vaderSentiment` sdist on PyPI,
offline), handed to the library's `prepare` (`raytrain_common.labelled.prepare`), which also reads
users' CSV / TSV / JSON Lines / Parquet files in any encoding on any storage and hub datasets.
Add your own to `sources()`: a name → a `NamedSource`."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pyarrow as pa

from hf_finetune.config import PREPARE_COMMAND, VADER_SOURCE, PrepareConfig
from raytrain_common.labelled.prepare import DataError, DatasetInfo, NamedSource
from raytrain_common.labelled.prepare import prepare as prepare_labelled
from raytrain_common.storage import StoragePath

VADER_SDIST = "vadersentiment==3.3.2"
VADER_FILES = {  # file in the sdist's inner archive → source name
    "tweets_GroundTruth.txt": "tweets",
    "movieReviewSnippets_GroundTruth.txt": "movie_reviews",
    "amazonReviewSnippets_GroundTruth.txt": "amazon_reviews",
    "nytEditorialSnippets_GroundTruth.txt": "nyt_editorials",
}


def download_vader(into: Path) -> Path:
    """The vaderSentiment source distribution from PyPI: its wheel lacks the rated sentences."""
    into.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
    command += ["--no-binary", ":all:", VADER_SDIST, "-d", str(into)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    archives = sorted(into.glob("vader*-3.3.2.tar.gz"), key=lambda p: p.name.lower())
    if done.returncode or not archives:
        raise DataError(
            f"could not download {VADER_SDIST} from PyPI ({done.stderr.strip()[-300:]}); "
            "download it elsewhere with `pip download --no-deps --no-binary :all: "
            f"{VADER_SDIST}` and pass the .tar.gz with --vader-sdist"
        )
    return archives[0]


def read_vader(sdist: Path) -> pa.Table:
    """VADER's 23,703 human-rated sentences: text, label (positive if the mean rating is > 0),
    source."""
    texts: list[str] = []
    labels: list[str] = []
    sources: list[str] = []
    with tarfile.open(sdist) as outer:
        inner_member = next(
            (m for m in outer.getmembers() if m.name.endswith("hutto_ICWSM_2014.tar.gz")), None
        )
        if inner_member is None:
            raise DataError(f"{sdist} holds no hutto_ICWSM_2014.tar.gz: is it {VADER_SDIST}?")
        inner_bytes = outer.extractfile(inner_member).read()  # type: ignore[union-attr]
    with tarfile.open(fileobj=io.BytesIO(inner_bytes)) as inner:
        for member in sorted(inner.getmembers(), key=lambda m: m.name):
            source = VADER_FILES.get(Path(member.name).name)
            if source is None:
                continue
            text = inner.extractfile(member).read()  # type: ignore[union-attr]
            lines = text.decode("utf-8").splitlines()
            for line in lines:
                parts = line.split("\t")
                if len(parts) < 3:
                    continue
                texts.append("\t".join(parts[2:]).strip())
                labels.append("positive" if float(parts[1]) > 0 else "negative")
                sources.append(source)
    if len(set(sources)) != len(VADER_FILES):
        raise DataError(f"{sdist} lacks some of {sorted(VADER_FILES)}: is it {VADER_SDIST}?")
    return pa.table({"text": texts, "label": labels, "source": sources})


def sources(options: PrepareConfig) -> dict[str, NamedSource]:
    """The recipe's named datasets: VADER, from --vader-sdist when given, else from PyPI."""

    def vader(download_dir: Path) -> tuple[pa.Table, str]:
        given = options.vader_sdist
        sdist = Path(given) if given else download_vader(download_dir)
        return read_vader(sdist), f"VADER human-rated sentences ({sdist.name})"

    # Stratified by the four sources: their sentences differ in length and tone.
    return {VADER_SOURCE: NamedSource("VADER", vader, stratify_by="source")}


def prepare(
    options: PrepareConfig,
    data_dir: StoragePath,
    model: str,
    download_dir: Path,
    force: bool = False,
) -> DatasetInfo:
    """Read, check, split and pre-tokenise the dataset `options` names; idempotent unless
    `force` (the library's `prepare`, with this recipe's sources)."""
    return prepare_labelled(
        options,
        data_dir,
        model,
        download_dir,
        force=force,
        named_sources=sources(options),
        prepare_command=PREPARE_COMMAND,
    )
