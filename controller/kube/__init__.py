"""The Kubernetes adapter: the only code in regroup that imports kubernetes_asyncio."""
