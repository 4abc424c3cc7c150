"""Helpers for testing wtransfer and wtransfer plugins (imported only by tests)."""
