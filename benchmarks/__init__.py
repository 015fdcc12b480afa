"""Benchmark, evaluation and simulation scripts: they import the product; nothing imports them."""
