"""Bundled tool parsers (the `tool_parser` slot): find the tool calls a model family
writes in its output text when a request offers tools with `tool_choice: "auto"`."""
