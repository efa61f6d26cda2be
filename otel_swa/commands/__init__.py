"""The subcommands of the ``otel-swa`` command line, one module each."""
