"""Beyond one machine: the cache sharded across processes, sent between them, and kept on disk."""
