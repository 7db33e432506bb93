"""Backends lower the optimised graph to one runtime's engine files."""
