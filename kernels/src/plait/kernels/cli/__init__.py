"""The ``plait`` command: subcommands contributed by installed plait distributions."""
