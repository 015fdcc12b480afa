"""Shared types and contracts: config, messages, membership, KV events, metric names (plain data
below the workers and the control layer; see docs/architecture.md, "Packages and layers")."""
