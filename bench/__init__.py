"""Benchmarks. Each compares regroup with its anchor in the same run and reports ratios."""
