"""Prompt data and rewards: grain prompt pipelines (``pipeline``) over JSONL / parquet /
ArrayRecord sources (``sources``), built-in procedural tasks (``tasks``), reward functions
(``rewards``) and small locally built tokenizers (``tokenizer``)."""
