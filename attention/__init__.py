"""Attention: KV layouts, attention groups, per-layer KV handles and backends."""
