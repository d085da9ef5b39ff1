"""The bundled speculative-decoding proposers (register_spec_proposers), one per module."""
