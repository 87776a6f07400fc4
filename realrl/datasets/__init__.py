"""Datasets: validated JSONL loaders, tokenized datasets, batch builders, the arithmetic task.

- ``realrl.datasets.jsonl``: ``read_jsonl`` / ``write_jsonl`` / ``DatasetError``;
- ``realrl.datasets.records``: the RL-prompt, SFT and paired record schemas and loaders;
- ``realrl.datasets.loader``: tokenized datasets, ``make_*_batch`` and ``EpochIterator``;
- ``realrl.datasets.arithmetic``: the built-in synthetic arithmetic task.
"""
