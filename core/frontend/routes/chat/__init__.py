"""POST /v1/chat/completions: the route, its serving (tools and tool calls included) and its body."""
