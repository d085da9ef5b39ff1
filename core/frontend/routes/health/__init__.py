"""/health, /ping and /version."""
