"""The JAX model runtime shared by the prefill and decode roles."""
