"""The `pagoda` command line (entry point `pagoda.services.cli.main:main`)."""
