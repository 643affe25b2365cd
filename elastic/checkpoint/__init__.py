"""Checkpoints on storage: committed, reshardable DCP folders, the state they hold, and the controller's requests for one."""
