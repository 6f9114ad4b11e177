"""Reference pipeline: a causal LM trained with FSDP2 (`fully_shard`) on packed Parquet, with Ray
Train."""

__version__ = "0.18.1"
