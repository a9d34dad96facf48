"""Benchmarks: `specdraft bench` (Spec-Bench style, per category) and `specdraft bench-runtime`."""
