"""The `jaxserve` command and its subcommands."""
