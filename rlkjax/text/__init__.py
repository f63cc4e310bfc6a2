"""Text: tokenizers (bytes, Hugging Face, Qwen3's built from its ranks) and the chat template. Imports only
rlkjax.core (tests/test_layers.py)."""
