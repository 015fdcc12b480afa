"""splitserve's cluster layer: config, launcher, membership, prefix index, the command line."""

# The one place the release version is written: pyproject.toml reads it (setuptools dynamic version),
# `splitserve --version` prints it, and the Helm chart's appVersion must equal it (tests/deploy).
__version__ = "0.1.0"
