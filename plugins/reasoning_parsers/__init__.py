"""Bundled reasoning parsers (the `reasoning_parser` slot): split a reasoning model's
output into its thinking and its answer."""
