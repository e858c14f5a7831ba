"""Benchmark programs. Each prints a table and writes JSON; the README quotes their output."""
