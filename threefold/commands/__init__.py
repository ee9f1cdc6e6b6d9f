"""The command line, one module per command. Each parses its arguments and calls the library, so
the CLI is a user of the public API (threefold/cli.py maps names to these modules)."""
