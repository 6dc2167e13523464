"""Routing policies: per-worker cost terms, then a choice among workers."""
