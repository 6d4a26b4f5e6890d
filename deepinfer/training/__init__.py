"""Data for training a small DeepSeek-architecture model on CPU: the stdlib corpus and its tokenizer.

`corpus` defines the text (CPython's own standard-library sources, split train/held-out by path hash);
`tokenizer_train` trains a byte-level BPE with DeepSeek's special tokens and V3.1 chat template on it.
"""
