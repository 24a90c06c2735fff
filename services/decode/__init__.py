"""decode-server: the client-facing Generate service."""
