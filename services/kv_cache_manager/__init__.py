"""The kv-cache-manager service: the cluster prefix index in Redis (see README.md)."""
