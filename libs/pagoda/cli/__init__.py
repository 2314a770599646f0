"""The `pagoda` command line (entry point `pagoda.cli.main:main`)."""
