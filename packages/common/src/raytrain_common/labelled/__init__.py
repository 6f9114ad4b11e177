"""Labelled text for a classifier, as a pipeline copies it unchanged: users' files prepared into
pre-tokenised splits, and those splits read by row in training.

    info = labelled.prepare.prepare(options, data_dir, model, download_dir,
                                    named_sources={...}, prepare_command="my-classifier prepare")
    info = labelled.prepare.inspect_dataset(data_dir, prepare_command)
    train = labelled.tokenized.TokenizedSplit(...)   # a map-style dataset the HF Trainer samples

Modules (import them by name, nothing is imported with the package): `prepare` (CSV / TSV /
JSON Lines / Parquet files in any encoding on any storage, a hub dataset or a pipeline's
`NamedSource` → the label vocabulary, a stratified seeded split, Parquet pre-tokenised with Ray
Data), `tokenized` (a split read by row index from a node-local row file, a fresh order every epoch
that a resumed epoch replays exactly, length grouping).
"""
