"""Interoperability with other ecosystems: the Hugging Face checkpoint layout."""
