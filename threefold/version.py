"""The package's version, on the lowest floor so that run records can stamp it without importing the package's API."""

__version__ = "0.1.0"
