"""The scheduling core: every request's state and blocks, and what a step produced. No device code, so
admission and caching are tested without JAX."""
