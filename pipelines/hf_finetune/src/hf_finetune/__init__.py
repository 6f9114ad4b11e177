"""Reference pipeline: Hugging Face Trainer fine-tuning a text classifier inside Ray Train."""

__version__ = "0.14.0"
