class ConfigError(Exception):
    """Bad input found before any expensive work: the message is one line that names the fix."""
