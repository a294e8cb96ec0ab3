"""Tokenizer training, offline corpus preprocessing and the streaming tokenize-and-pack pipeline."""
