"""Corpus, tokenizer, packing and the resumable batch order."""
