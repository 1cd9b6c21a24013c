"""Benchmarks: print a table, write JSON."""
