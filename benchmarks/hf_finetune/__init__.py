"""hf_finetune's benchmarks, run by its nox sessions (pipelines/hf_finetune/sessions.py)."""
