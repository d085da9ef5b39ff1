"""The bundled poolers (interfaces.pooling.Pooler), one per file: last token, mean of the
tokens, the CLS (first) token, and every token."""
