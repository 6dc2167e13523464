"""Benchmarks: gateway overhead, index speed, trace replay across routers."""
