"""pytest fixtures for the Kubernetes API stand-in (filled in with the stand-in itself)."""
