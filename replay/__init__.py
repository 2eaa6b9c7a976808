"""replay: record, replay and bisect training instabilities of GPT-2 runs."""

__version__ = "0.1.0"
