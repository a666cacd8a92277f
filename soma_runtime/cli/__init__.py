"""The `soma-runtime` command line."""
