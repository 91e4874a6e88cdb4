"""Benchmark suites (not tests): `normfold bench ops`, `normfold bench model`."""
