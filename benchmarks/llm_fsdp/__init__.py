"""llm_fsdp's benchmarks, run by its nox sessions (pipelines/llm_fsdp/sessions.py)."""
