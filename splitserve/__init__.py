"""Entry points: the `splitserve` command line and the serving processes (above every product package)."""
