class ConfigError(Exception):
    """Bad input found before any expensive work: the message is one line that names the fix."""


def run_cli(main) -> None:
    """Run a command's `main`; a ConfigError ends it with its one line on stderr and exit code 2, no traceback."""
    import sys

    try:
        sys.exit(main())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
