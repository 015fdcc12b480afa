"""Entry points: the `splitserve` command line and the serving processes (above every product package)."""

# The one place the release version is written: pyproject.toml reads it (setuptools dynamic version),
# `splitserve --version` prints it, and the Helm chart's appVersion must equal it (tests/test_dependencies.py).
__version__ = "0.1.0"
