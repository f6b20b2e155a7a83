"""Errors a user can cause. The CLI prints these as one clear message, without a traceback."""


class ConfigError(ValueError):
    """An invalid configuration value: the message names the option and what would be valid."""
