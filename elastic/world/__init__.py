"""One world's life: its process groups, the per-step agreement, stops, batches per rank, and what rank 0 tells etcd."""
