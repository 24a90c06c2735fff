"""Loading: model references (a GGUF file, a Hugging Face folder, a known name), checkpoints -> weights,
GGUF metadata -> config."""
