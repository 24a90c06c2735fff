"""prefill-server: prefills prompts and streams their KV to decode servers."""
