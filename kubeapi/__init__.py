"""A Kubernetes API server stand-in: the real ``kubernetes_asyncio`` client talks to it over HTTP.

Tests and benchmarks import it; nothing the controller ships does (see docs/testing-kubeapi.md)."""
