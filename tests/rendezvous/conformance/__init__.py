"""torch's own rendezvous scenarios, run against etcd-v3 with torch's c10d as the control."""
