"""POST /v1/responses, OpenAI's Responses API served as the chat completion it describes."""
