"""The `engine` command line: one Typer app, one module per command. Parses and validates flags into the
frozen configs the library takes, and turns EngineError into one line and an exit status. Nothing imports it.
"""
